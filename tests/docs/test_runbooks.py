"""Keep the README and runbooks true: every project command they show must exist.

Collects commands from fenced code blocks and inline code in README.md and
runbooks/*.md, then checks that each make target, training module and flag, job
script and cdk context key they name exists, and that relative links resolve.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "runbooks").glob("*.md")])
FENCE = re.compile(r"```[a-zA-Z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _command_lines(text: str) -> list[str]:
    """Shell lines from code blocks (continuations joined) plus inline code spans."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ").strip()
            if line and not line.startswith("#"):
                lines.extend(part.strip() for part in re.split(r"&&|;|\|\|", line))
    stripped = FENCE.sub("", text)
    lines.extend(span.strip() for span in INLINE.findall(stripped))
    return lines


def _commands(kind: str) -> list[tuple[str, str]]:
    """(doc, command) pairs whose command invokes the project in the given way."""
    patterns = {
        "make": re.compile(r"^make(\s|$)"),
        "python": re.compile(r"(^|\s)python3? -m training(\.[a-z_]+)?(\s|$)"),
        "sbatch": re.compile(r"(^|\s)sbatch\s"),
        "cdk": re.compile(r"(^|\s)(npx )?cdk\s"),
    }
    found = []
    for doc in DOCS:
        for line in _command_lines(doc.read_text()):
            if patterns[kind].search(line):
                found.append((_rel(doc), line))
    return found


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return command.split()


@functools.cache
def _make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-zA-Z][\w-]*)\s*:(?!=)", text, re.M))


@functools.cache
def _module_help(module: str) -> str:
    python = REPO / ".venv" / "bin" / "python"
    proc = subprocess.run([str(python if python.exists() else sys.executable), "-m", module, "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"`python -m {module} --help` failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_docs_exist_and_show_project_commands():
    assert (REPO / "README.md").exists()
    assert len(DOCS) > 5, "runbooks/ should hold the operator pages"
    assert _commands("make"), "README should show the make quickstart"


@pytest.mark.parametrize(("doc", "command"), _commands("make"))
def test_make_targets_exist(doc, command):
    for target in _tokens(command)[1:]:
        if target.startswith("-") or "=" in target:
            continue
        assert target in _make_targets(), f"{doc}: `{command}` names make target {target!r}, not in Makefile"


@pytest.mark.parametrize(("doc", "command"), _commands("python"))
def test_training_modules_and_flags_exist(doc, command):
    tokens = _tokens(command)
    module = tokens[tokens.index("-m") + 1]
    path = REPO / Path(*module.split("."))
    assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), \
        f"{doc}: `{command}` runs {module}, which does not exist"
    helptext = _module_help(module)
    for flag in (t.split("=")[0] for t in tokens if t.startswith("--")):
        assert flag in helptext, f"{doc}: `{command}` uses {flag}, not in `python -m {module} --help`"


@pytest.mark.parametrize(("doc", "command"), _commands("sbatch"))
def test_job_scripts_exist(doc, command):
    scripts = [t for t in _tokens(command) if t.endswith(".sbatch")]
    if not scripts and "..." in command:
        pytest.skip(f"{doc}: `{command}` is an abbreviation, not a command")
    assert scripts, f"{doc}: `{command}` submits no .sbatch script"
    for script in scripts:
        assert (REPO / script).exists() or (REPO / "training" / "slurm" / Path(script).name).exists(), \
            f"{doc}: `{command}` submits {script}, which does not exist"


def _doc_links() -> list[tuple[str, str]]:
    links = []
    for doc in DOCS:
        prose = INLINE.sub("", FENCE.sub("", doc.read_text()))
        for target in LINK.findall(prose):
            if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
                links.append((_rel(doc), target))
    return links


@pytest.mark.parametrize(("doc", "target"), _doc_links())
def test_relative_links_resolve(doc, target):
    path = (REPO / doc).parent / target.split("#")[0]
    assert path.exists(), f"{doc}: link to {target} does not resolve"


def _platform_keys() -> set[str]:
    from stacks.config import PlatformConfig

    return set(PlatformConfig.keys())


@pytest.mark.parametrize(("doc", "command"), _commands("cdk"))
def test_cdk_context_overrides_are_platform_keys(doc, command):
    keys = [k for k in re.findall(r"(?:-c|--context)\s+([A-Za-z][\w]*)=", command) if k != "key"]
    for key in keys:
        assert key in _platform_keys(), f"{doc}: `{command}` sets context key {key!r}, not in PlatformConfig"


def _configure_table_keys() -> set[str]:
    """Keys in the first column of configure.md's tables (`key` in backticks)."""
    text = (REPO / "runbooks" / "configure.md").read_text()
    first_cells = re.findall(r"^\|([^|\n]*)\|", text, re.M)
    return {key for cell in first_cells for key in re.findall(r"`([A-Za-z]\w*)`", cell)}


def test_configure_md_documents_every_platform_key():
    missing = _platform_keys() - _configure_table_keys()
    assert not missing, f"runbooks/configure.md does not document context keys: {sorted(missing)}"


def test_configure_md_documents_only_real_keys():
    unknown = _configure_table_keys() - _platform_keys()
    assert not unknown, f"runbooks/configure.md documents keys PlatformConfig does not have: {sorted(unknown)}"


def test_readme_config_table_matches_cdk_json_defaults():
    """The README's configuration table shows each key with cdk.json's default."""
    import json

    context = json.loads((REPO / "cdk.json").read_text())["context"]
    readme = (REPO / "README.md").read_text()
    for key in _platform_keys():
        row = re.search(rf"^\|\s*`{key}`\s*\|([^\n]*)$", readme, re.M)
        assert row, f"README.md configuration table has no row for {key}"
        if key in context and context[key] not in ("", None):
            default = json.dumps(context[key]) if isinstance(context[key], (bool, list)) else str(context[key])
            assert default in row.group(1), f"README.md row for {key} does not show the cdk.json default {default}"


SECTIONS = ("model", "data", "objective", "optim", "checkpoint", "gpu", "trainium", "ema", "tracking", "prometheus")
FILE_SUFFIXES = {"safetensors", "pt", "json", "jsonl", "yaml", "tar", "txt", "png"}
CONFIG_KEY = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})\.[a-z_]+)(?=[\s:=`]|$)")


@functools.cache
def _train_config_keys() -> frozenset[str]:
    from training.config import load_config

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict) and value and key != "overrides":
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield prefix + key

    cfg = load_config(["--config", str(REPO / "training" / "configs" / "tiny-cpu.yaml")])
    return frozenset(flat(cfg.to_dict()))


def _config_key_mentions() -> list[tuple[str, str]]:
    """Training config keys the docs name in code (`optim.lr`, `--set data.path=...`)."""
    found = set()
    for doc in DOCS:
        for line in _command_lines(doc.read_text()):
            if "error:" in line:  # an example of the message for a wrong key
                continue
            for key in CONFIG_KEY.findall(line):
                if key.rsplit(".", 1)[1] not in FILE_SUFFIXES:
                    found.add((_rel(doc), key))
    return sorted(found)


@pytest.mark.parametrize(("doc", "key"), _config_key_mentions())
def test_training_config_keys_exist(doc, key):
    assert key in _train_config_keys(), f"{doc}: names training config key {key!r}, which TrainConfig lacks"


# --------------------------------------------------------------------------- stack outputs

#: Names shaped like stack outputs that the docs use for something else, each a property of an
#: AWS resource or API the text quotes.
NOT_OUTPUTS = {
    "SourceS3Uri": "LifeCycleConfig.SourceS3Uri of AWS::SageMaker::Cluster",
    "SecretArn": "ClusterAccountingDatabase.SecretArn of AWS::SageMaker::Cluster",
    "KmsKeyId": "the KMS key property of several AWS resources",
    "VolumeKmsKeyId": "ClusterEbsVolumeConfig.VolumeKmsKeyId of AWS::SageMaker::Cluster",
    "ImageId": "ClusterInstanceGroup.ImageId of AWS::SageMaker::Cluster (a custom AMI)",
}
OUTPUT_SHAPE = re.compile(r"(?:`|<)([A-Z][a-z0-9]+(?:[A-Z0-9][a-z0-9]*)*(?:Bucket|Uri|Name|Arn|Id|Url))(?:`|>)")
STACK_OUTPUT = re.compile(r"\b(network|storage|cluster|serving|observability) stack(?:'s)? outputs? `([A-Za-z0-9]+)`")


@functools.cache
def _stack_outputs() -> dict[str, str]:
    """Output name -> stack kind, of an app with every optional stack and resource on."""
    import os

    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    import aws_cdk as cdk

    from stacks.platform import build_app

    platform = build_app({"slurmAccounting": "true", "serving": "true", "servingModelDataUrl":
                          "s3://sana-artefacts-123456789012-us-east-1/serving/model-0123456789ab.tar.gz",
                          "grafana": "true", "mlflowTrackingServer": "true"})
    outputs = {}
    for stack in (platform.network, platform.storage, platform.cluster, platform.serving, platform.observability):
        kind = stack.stack_name.rsplit("-", 1)[1]
        for construct in stack.node.find_all():
            if isinstance(construct, cdk.CfnOutput):
                outputs[construct.node.id] = kind
    return outputs


def _output_mentions() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for name in OUTPUT_SHAPE.findall(doc.read_text()):
            if name not in NOT_OUTPUTS:
                found.add((_rel(doc), name))
    return sorted(found)


@pytest.mark.parametrize(("doc", "name"), _output_mentions())
def test_every_stack_output_the_docs_name_exists(doc, name):
    assert name in _stack_outputs(), f"{doc}: names stack output `{name}`, which no stack has " \
        f"(outputs: {', '.join(sorted(_stack_outputs()))}); if it is not an output, add it to NOT_OUTPUTS"


@pytest.mark.parametrize(("doc", "kind", "name"), sorted(
    {(_rel(d), k, n) for d in DOCS for k, n in STACK_OUTPUT.findall(d.read_text())}))
def test_outputs_are_named_with_the_stack_that_has_them(doc, kind, name):
    assert _stack_outputs().get(name) == kind, f"{doc}: says the {kind} stack has output {name}; it is the " \
        f"{_stack_outputs().get(name, 'no')} stack's"


# --------------------------------------------------------------------------- /fsx paths

FSX_PATH = re.compile(r"(?<![\w$}])/fsx/([A-Za-z0-9_%-][A-Za-z0-9_.%-]*)(?:/([^\s`'\")\]|,;:]+))?")
#: Where each top-level FSx directory comes from; the per-user trees take a user as their next part.
USER_TREES = {"runs", "exports"}
USER_PLACEHOLDERS = ("<user>", "$USER", "${USER}", "%u", "$(whoami)")


@functools.cache
def _fsx_top_dirs() -> frozenset[str]:
    """Top-level directories of FSx the lifecycle creates (shared_dirs.sh, container_runtime.sh,
    observability.sh, wheelhouse.sh, the users' homes) and the two data repository associations
    (stacks/storage.py)."""
    from stacks.config import HOME_ROOT
    from stacks.storage import FSX_ARTEFACTS_PATH, FSX_DATA_PATH

    made = set()
    for script in ("shared_dirs.sh", "container_runtime.sh", "observability.sh", "wheelhouse.sh"):
        for line in (REPO / "lifecycle_scripts" / script).read_text().splitlines():
            match = re.match(r'\s*safe_fs dir "\$FSX" \S+ \S+ (.+)$', line)
            if match:
                made |= {part.split("/")[0] for part in match.group(1).split()}
    made |= {HOME_ROOT.split("/")[2], FSX_DATA_PATH.strip("/"), FSX_ARTEFACTS_PATH.strip("/")}
    return frozenset(made)


def _fsx_mentions() -> list[tuple[str, str, str]]:
    found = set()
    for doc in DOCS:
        for line in _command_lines(doc.read_text()):
            for top, rest in FSX_PATH.findall(line):
                found.add((_rel(doc), top, rest.split("/")[0] if rest else ""))
    return sorted(found)


@pytest.mark.parametrize(("doc", "top", "sub"), _fsx_mentions())
def test_every_fsx_path_the_docs_use_is_one_the_lifecycle_creates(doc, top, sub):
    assert top in _fsx_top_dirs(), f"{doc}: uses /fsx/{top}/..., which nothing creates (lifecycle_scripts/" \
        f"shared_dirs.sh makes {', '.join(sorted(_fsx_top_dirs()))})"
    if top in USER_TREES:
        assert sub in ("", *USER_PLACEHOLDERS), f"{doc}: /fsx/{top}/{sub}: /fsx/{top} holds one private directory " \
            f"per user (shared_dirs.sh); write /fsx/{top}/$USER/..."


# --------------------------------------------------------------------------- modules and scripts

@pytest.mark.parametrize(("doc", "command"), [
    (doc, line) for doc in DOCS for line in _command_lines(doc.read_text())
    if re.search(r"(^|\s)python3? -m (stacks|containers)\.[a-z_]+", line)])
def test_platform_modules_and_flags_exist(doc, command):
    tokens = _tokens(command)
    module = tokens[tokens.index("-m") + 1]
    assert (REPO / Path(*module.split("."))).with_suffix(".py").exists(), f"{doc}: `{command}` runs {module}"
    helptext = _module_help(module)
    for flag in (t.split("=")[0] for t in tokens if t.startswith("--")):
        assert flag in helptext, f"{doc}: `{command}` uses {flag}, not in `python -m {module} --help`"


@pytest.mark.parametrize(("doc", "script"), sorted(
    {(_rel(d), s) for d in DOCS for s in re.findall(r"(?<!tests/)lifecycle(?:_scripts)?/([a-z_]+\.(?:sh|py))",
                                                        d.read_text())}))
def test_lifecycle_scripts_the_docs_name_exist(doc, script):
    assert (REPO / "lifecycle_scripts" / script).exists(), f"{doc}: names lifecycle script {script}"
