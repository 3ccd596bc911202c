"""The content hash a lifecycle package is uploaded and installed under (stdlib only).

One implementation for both ends: the cluster stack names the upload prefix
``s3://<lifecycle bucket>/lifecycle/<hash>/`` with it (stacks/cluster.py loads this file), and
rollout.sh recomputes it on the node over what it fetched, so a prefix whose content is not
what its name says is refused before root installs anything from it.

    python3 package_hash.py LIFECYCLE_DIR TRAINING_DIR   -> prints the hash
    (LIFECYCLE_DIR/platform-settings.json, when present, is hashed as the node settings)

The hash: 16 hex digits of SHA-256 over, for each tree in order (lifecycle_scripts, then
training), every uploaded file's "<tree name>/<relative path>\\0" followed by the SHA-256 of
its bytes, files in sorted path order, then (for a deployment's package) the node settings.
Uploaded = not under a name matching EXCLUDED_NAMES (the BucketDeployment's exclude globs are
the same list).

The node settings (platform-settings.json: users, admins, groups, envs...) are part of what a
node installs, so a change of them alone is a new hash, a new prefix and a rollout like any
code change (runbooks/rollout.md). Hashed: the canonical JSON of every key except
ENVIRONMENT_KEYS, the values of the account and region the stacks are deployed to (CDK tokens
at synth, resolved only in S3) and the hash itself. Without settings (``settings=None``) the
hash covers the code alone: what containers/image.py labels an image with.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

#: Never uploaded (byte-code caches, tests, hidden files): the S3 deployment excludes the same.
EXCLUDED_NAMES = ("__pycache__", "tests", ".*", "*.pyc")
#: Tree names as the hash sees them (the repository's directory names).
TREE_NAMES = ("lifecycle_scripts", "training")
#: Written by the stack next to the scripts, not part of the hashed tree (it holds the hash);
#: its content, less ENVIRONMENT_KEYS, is hashed as the node settings.
SETTINGS_FILE = "platform-settings.json"
#: Settings keys the hash leaves out: the hash itself, and what only the deployment's account
#: and region decide (unresolved tokens when the stack computes the hash).
ENVIRONMENT_KEYS = ("package_hash", "region", "data_bucket", "artefacts_bucket", "lifecycle_bucket",
                    "image_registry", "remote_write_url")


def excluded(rel: Path) -> bool:
    """Whether a path (relative to its tree) is one the upload leaves out."""
    return any(fnmatch.fnmatchcase(part, pattern) for part in rel.parts for pattern in EXCLUDED_NAMES)


def package_files(root: Path) -> Iterator[Path]:
    """Files of ``root`` that are uploaded, sorted by path (symlinks are followed, as CDK's asset copy does)."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not excluded(path.relative_to(root)):
            yield path


def tree_digest(trees: list[tuple[str, Path]], *, skip: tuple[str, ...] = ()) -> str:
    """16 hex digits over (tree name, relative path, content) of every uploaded file of ``trees``.

    ``skip``: relative paths (within their tree, "name/rel") left out, e.g. the settings file
    that sits beside the fetched lifecycle scripts but was never part of the hashed tree.
    """
    digest = hashlib.sha256()
    for name, root in trees:
        for path in package_files(root):
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            if rel in skip:
                continue
            digest.update(f"{rel}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def hashed_settings(settings: dict) -> bytes:
    """The part of the node settings the hash covers, as canonical JSON bytes."""
    kept = {key: value for key, value in settings.items() if key not in ENVIRONMENT_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def package_hash(lifecycle_dir: Path, training_dir: Path, settings: dict | None = None) -> str:
    """The hash of a deployment's package (the code and ``settings``, what `cdk deploy` uploads)
    or, with ``settings=None``, of the code alone."""
    trees = [(TREE_NAMES[0], lifecycle_dir), (TREE_NAMES[1], training_dir)]
    code = tree_digest(trees, skip=(f"{TREE_NAMES[0]}/{SETTINGS_FILE}",))
    if settings is None:
        return code
    return hashlib.sha256(f"{code}\0settings\0".encode() + hashed_settings(settings)).hexdigest()[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: package_hash.py LIFECYCLE_DIR TRAINING_DIR", file=sys.stderr)
        return 2
    lifecycle_dir = Path(argv[0])
    settings_file = lifecycle_dir / SETTINGS_FILE
    settings = None
    if settings_file.is_file():
        try:
            settings = json.loads(settings_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            print(f"{settings_file}: not valid JSON ({exc})", file=sys.stderr)
            return 1
        if not isinstance(settings, dict):
            print(f"{settings_file}: top level is not an object", file=sys.stderr)
            return 1
    print(package_hash(lifecycle_dir, Path(argv[1]), settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
