"""``make wheelhouse``: every pinned requirement of the node envs, resolved for the nodes, with hashes.

A private cluster (``privateNetwork=true``) cannot reach PyPI or Neuron's pip repository, so its
envs are installed from a wheelhouse built here, where the internet is reachable:

    python -m stacks.wheelhouse build gpu neuron

For each env kind, ``pip download`` resolves ``training/requirements-<kind>.txt`` for the nodes'
platform (CPython ``NODE_PYTHON``, manylinux x86_64 up to the nodes' glibc, wheels only: the nodes
build nothing) into ``build/wheelhouse/<kind>-<key>/``, then lifecycle_scripts/wheelhouse.py writes
``requirements.lock`` (one ``name==version --hash=sha256:`` line per wheel) and ``wheelhouse.json``.
``<key>`` hashes the requirements file, the target and the indexes: an unchanged set is never
downloaded again, and a changed one lands beside the old one. The Neuron wheels (torch-neuronx,
neuronx-cc, libneuronxla) come from Neuron's repository (``stacks.config.NEURON_PIP_INDEX``, the
same setting the online build uses), here and not on the node.

The cluster stack uploads each wheelhouse the cluster needs to ``s3://<lifecycle bucket>/wheelhouse/
<kind>-<key>/`` and names it, with the lock's sha256 and its Python, in platform-settings.json;
lifecycle_scripts/python_env.sh installs from it with ``--no-index --require-hashes``.

Why the build runs on Linux x86_64 with the nodes' Python: pip evaluates environment markers
(``python_version < "3.12"``, torch's ``platform_machine == "x86_64"`` for its CUDA libraries) for
the machine and interpreter it runs on, whatever ``--python-version``/``--platform`` say; those
only select wheel tags and ``Requires-Python``. And ``--platform`` takes the tags literally (a
wheel tagged manylinux_2_28 is not picked for ``--platform manylinux_2_35``), so every tag a
node's pip accepts is passed, newest first, as ``packaging.tags`` orders them.

The same versions as an online build: the wheels-only resolution can differ from what pip picks
with an index (a newer release with only an sdist, which the online build would compile). So after
the download the builder resolves the same requirements the online way (``pip install --dry-run
--report``, same indexes) and refuses, in one line, any package whose version differs: pin it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from stacks.config import NEURON_PIP_INDEX

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "build" / "wheelhouse"
#: The interpreter lifecycle_scripts/python_env.sh builds the envs with (LIFECYCLE_MIN_PYTHON, the
#: first it looks for); a private node must have exactly this one.
NODE_PYTHON = "3.11"
#: glibc of the HyperPod AMIs' Ubuntu 22.04 (2.35); a wheel for a newer glibc would not load there.
NODE_GLIBC = "2.35"
#: Bump when the build recipe changes (a new key for every wheelhouse).
RECIPE = 1
REQUIREMENTS = {"gpu": REPO / "training" / "requirements-gpu.txt",
                "neuron": REPO / "training" / "requirements-neuron.txt"}
INDEXES: dict[str, tuple[str, ...]] = {"gpu": (), "neuron": (NEURON_PIP_INDEX,)}
#: Largest wheelhouse part one upload carries: the deployment handler holds a part twice (the
#: archive and its contents) in its 10 GiB of /tmp (stacks/cluster.py WheelhouseUpload).
UPLOAD_PART_BYTES = 4 << 30


def load_lifecycle_module(filename: str, name: str) -> ModuleType:
    """A module of lifecycle_scripts/ (run on the nodes, outside any package) loaded by path:
    the deploy host and the nodes share ONE implementation of a lock format or pin table."""
    spec = importlib.util.spec_from_file_location(name, REPO / "lifecycle_scripts" / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


lock = load_lifecycle_module("wheelhouse.py", "sana_wheelhouse_lock")
LOCK, MANIFEST, LockError = lock.LOCK, lock.MANIFEST, lock.LockError


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be built or is missing; ``str()`` is one line naming the fix."""


@dataclass(kw_only=True, frozen=True)
class Target:
    """The nodes' interpreter and C library: what the wheels must run on."""

    python: str = NODE_PYTHON
    glibc: str = NODE_GLIBC

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d{1,2}", self.python):
            raise ValueError(f"python {self.python!r}: expected a CPython 3 minor version such as 3.11")
        if not re.fullmatch(r"2\.\d{1,2}", self.glibc) or int(self.glibc.split(".")[1]) < 17:
            raise ValueError(f"glibc {self.glibc!r}: expected 2.17 or newer, e.g. 2.35 (Ubuntu 22.04)")

    @property
    def platforms(self) -> tuple[str, ...]:
        """Every manylinux x86_64 tag a node's pip accepts, newest first; the legacy alias follows
        the glibc it stands for (pypa/packaging src/packaging/_manylinux.py platform_tags)."""
        legacy = {17: "manylinux2014_x86_64", 12: "manylinux2010_x86_64", 5: "manylinux1_x86_64"}
        tags: list[str] = []
        for minor in range(int(self.glibc.split(".")[1]), 4, -1):
            tags.append(f"manylinux_2_{minor}_x86_64")
            if minor in legacy:
                tags.append(legacy[minor])
        return tuple(tags)


@dataclass(kw_only=True, frozen=True)
class Wheelhouse:
    kind: str
    key: str
    path: Path
    python: str
    lock_sha256: str
    wheels: int
    bytes: int

    @property
    def prefix(self) -> str:
        """Where the cluster stack uploads it in the lifecycle bucket."""
        return f"wheelhouse/{self.kind}-{self.key}/"

    def settings(self) -> dict[str, str]:
        """Its entry in platform-settings.json ``wheelhouses`` (lifecycle_scripts/settings.sh reads it)."""
        return {"prefix": self.prefix, "lock_sha256": self.lock_sha256, "python": self.python}

    def upload_parts(self, max_bytes: int = UPLOAD_PART_BYTES) -> list[list[str]]:
        """File names in parts of at most ``max_bytes`` (a bigger wheel is a part of its own); the
        lock and manifest travel in the first part."""
        parts: list[list[str]] = [[LOCK, MANIFEST]]
        size = 0
        for wheel in sorted(self.path.glob("*.whl")):
            n = wheel.stat().st_size
            if size and size + n > max_bytes:
                parts.append([])
                size = 0
            parts[-1].append(wheel.name)
            size += n
        return parts


def key(kind: str, target: Target, requirements: Path | None = None) -> str:
    """16 hex digits of the requirements, the target, the indexes and the recipe."""
    requirements = requirements or REQUIREMENTS[kind]
    digest = hashlib.sha256(requirements.read_bytes())
    for part in (target.python, target.glibc, *INDEXES[kind], f"recipe={RECIPE}"):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def location(kind: str, target: Target = Target(), *, root: Path = ROOT, requirements: Path | None = None) -> Path:
    return root / f"{kind}-{key(kind, target, requirements)}"


def load(kind: str, target: Target = Target(), *, root: Path = ROOT, requirements: Path | None = None) -> Wheelhouse:
    """The built wheelhouse of ``kind`` for the current requirements; WheelhouseError if absent."""
    path = location(kind, target, root=root, requirements=requirements)
    manifest = path / MANIFEST
    if not manifest.is_file():
        req = (requirements or REQUIREMENTS[kind])
        shown = req.relative_to(REPO) if req.is_relative_to(REPO) else req
        raise WheelhouseError(f"no wheelhouse of {shown} for CPython {target.python} at {path}: run "
                              f"`make wheelhouse` (it is keyed by the requirements, so an edited file needs a new one)")
    data = json.loads(manifest.read_text())
    return Wheelhouse(kind=kind, key=data["key"], path=path, python=data["python"], lock_sha256=data["lock_sha256"],
                      wheels=data["wheels"], bytes=data["bytes"])


def finish(incoming: Path, *, kind: str, target: Target, root: Path = ROOT,
           requirements: Path | None = None) -> Wheelhouse:
    """Lock + manifest for the wheels in ``incoming``, then rename it into place (complete or absent)."""
    requirements = requirements or REQUIREMENTS[kind]
    k = key(kind, target, requirements)
    header = (f"wheelhouse {kind}-{k}: {requirements.name} for CPython {target.python}, manylinux x86_64 "
              f"(glibc <= {target.glibc}); written by stacks/wheelhouse.py, checked by lifecycle_scripts/wheelhouse.py")
    lock_sha256 = lock.write_lock(incoming, header)
    wheels = sorted(incoming.glob("*.whl"))
    manifest = {"kind": kind, "key": k, "python": target.python, "glibc": target.glibc,
                "requirements_sha256": hashlib.sha256(requirements.read_bytes()).hexdigest(),
                "indexes": list(INDEXES[kind]), "lock_sha256": lock_sha256, "wheels": len(wheels),
                "bytes": sum(w.stat().st_size for w in wheels)}
    (incoming / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    dest = root / f"{kind}-{k}"
    incoming.chmod(0o755)
    os.rename(incoming, dest)
    return load(kind, target, root=root, requirements=requirements)


def python_version(python: str) -> str:
    """``3.11`` for the interpreter at ``python``; WheelhouseError if it does not run."""
    try:
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
    except OSError as err:
        raise WheelhouseError(f"make wheelhouse: cannot run {python}: {err.strerror}") from None
    if done.returncode != 0:
        raise WheelhouseError(f"make wheelhouse: cannot run {python}: {(done.stderr.strip() or 'no output').splitlines()[-1]}")
    return done.stdout.strip()


def online_versions(kind: str, requirements: Path, *, python: str, env: dict[str, str] | None) -> dict[str, str]:
    """name -> version that ``pip install -r requirements`` picks here with the kind's indexes (a dry run)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                               "--disable-pip-version-check", "--no-input", "--report", str(report),
                               "-r", str(requirements),
                               *[arg for index in INDEXES[kind] for arg in ("--extra-index-url", index)]],
                              capture_output=True, text=True, env=env)
        if done.returncode != 0:
            errors = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith("ERROR")]
            raise WheelhouseError(f"make wheelhouse {kind}: the online resolution of {requirements.name} failed: "
                                  f"{errors[-1] if errors else f'exit status {done.returncode}'}")
        installs = json.loads(report.read_text())["install"]
    return {lock.canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def compare_with_online(kind: str, incoming: Path, online: dict[str, str]) -> None:
    """One-line WheelhouseError when the wheels differ from the online resolution."""
    wheels = {}
    for path in incoming.glob("*.whl"):
        match = lock.WHEEL.match(path.name)
        if match:
            wheels[lock.canonical(match["name"])] = match["version"]
    differ = [f"{name} {online.get(name, 'absent')} online, {wheels.get(name, 'absent')} as a wheel"
              for name in sorted(set(online) | set(wheels)) if online.get(name) != wheels.get(name)]
    if differ:
        raise WheelhouseError(f"make wheelhouse {kind}: an online build would install other versions than the "
                              f"wheels for the nodes ({'; '.join(differ)}): pin them in "
                              f"training/requirements-{kind}.txt to versions that have wheels")


def build(kind: str, target: Target = Target(), *, root: Path = ROOT, requirements: Path | None = None,
          python: str = sys.executable, env: dict[str, str] | None = None) -> tuple[Wheelhouse, bool]:
    """(the wheelhouse, whether it was downloaded now): cached by key, else ``python -m pip download``."""
    if kind not in REQUIREMENTS:
        raise WheelhouseError(f"unknown env kind {kind!r}; the node envs are {', '.join(REQUIREMENTS)}")
    try:
        return load(kind, target, root=root, requirements=requirements), False
    except WheelhouseError:
        pass
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise WheelhouseError(f"make wheelhouse: runs on Linux x86_64 only (this is {sys.platform} "
                              f"{platform.machine()}): pip resolves markers such as platform_machine for the machine "
                              "it runs on; run it in a Linux x86_64 container or CI")
    running = python_version(python)
    if running != target.python:
        raise WheelhouseError(f"make wheelhouse: this pip runs on Python {running} but the nodes' envs use "
                              f"{target.python}, and pip resolves environment markers for the Python it runs "
                              f"on: run it with a Python {target.python} (PY=<python{target.python}>)")
    requirements = requirements or REQUIREMENTS[kind]
    root.mkdir(parents=True, exist_ok=True)
    incoming = Path(tempfile.mkdtemp(dir=root, prefix=f".incoming-{kind}-"))
    cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "--only-binary=:all:",
           "--implementation", "cp", "--python-version", target.python,
           *[arg for tag in target.platforms for arg in ("--platform", tag)],
           "--dest", str(incoming), "-r", str(requirements),
           *[arg for index in INDEXES[kind] for arg in ("--extra-index-url", index)]]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            errors = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith("ERROR")]
            cause = errors[-1] if errors else f"exit status {done.returncode}"
            raise WheelhouseError(f"make wheelhouse {kind}: pip download of {requirements.name} for CPython "
                                  f"{target.python} manylinux_{target.glibc.replace('.', '_')}_x86_64 failed: {cause}")
        compare_with_online(kind, incoming, online_versions(kind, requirements, python=python, env=env))
        return finish(incoming, kind=kind, target=target, root=root, requirements=requirements), True
    except LockError as err:
        raise WheelhouseError(f"make wheelhouse {kind}: {err}") from None
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.wheelhouse", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and lock the wheelhouse of each env kind (cached by key)")
    b.add_argument("kinds", nargs="*", default=list(REQUIREMENTS), help="env kinds (default: gpu neuron)")
    b.add_argument("--python", default=NODE_PYTHON, help=f"the nodes' CPython (default {NODE_PYTHON})")
    b.add_argument("--glibc", default=NODE_GLIBC, help=f"the nodes' glibc (default {NODE_GLIBC})")
    b.add_argument("--root", type=Path, default=ROOT, help="where wheelhouses are kept (default build/wheelhouse)")
    args = parser.parse_args(argv)
    try:
        target = Target(python=args.python, glibc=args.glibc)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for kind in args.kinds:
        started = time.monotonic()
        try:
            wheelhouse, downloaded = build(kind, target, root=args.root)
        except WheelhouseError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        how = f"downloaded in {time.monotonic() - started:.0f}s" if downloaded else "cached"
        print(f"wheelhouse {kind}-{wheelhouse.key}: {wheelhouse.wheels} wheels, {wheelhouse.bytes / 2**30:.2f} GiB, "
              f"CPython {wheelhouse.python}, {how}: {wheelhouse.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
