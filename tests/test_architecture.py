"""The layout ARCHITECTURE.md describes holds: no import cycle in training/, stacks/ or
containers/; no module of training/ imports a layer above its own; no module over 600
lines; at most 14 modules directly in training/; and every document the code or the docs
cite is in the repository (CONTRIBUTING.md, 4 and 10).

The import graph is read from the source (``ast``), not by importing: every ``import`` and
``from ... import`` counts, those inside functions too (a lazy import is still a dependency),
except under ``if TYPE_CHECKING:``. ``from package import name`` depends on the submodule
``package.name`` when that is a module, else on the package itself.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "stacks", "containers")
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 14

#: training/'s layers, low to high (ARCHITECTURE.md, "Layers"): a module imports its own layer and below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "s3", "provenance", "metrics", "observability"),
    ("data",),
    ("model", "optim", "objective"),
    ("backends", "evaluation"),
    ("checkpoint", "failure"),
    ("config",),
    ("loop",),
    ("perf", "serve", "gpu", "trainium"),
    ("report", "smoke", "precompute", "export", "bench"),
    ("pipeline", "demo"),
)
#: what stacks/ may import from training/: torch-free modules the deploy venv can load
#: (stacks/cost.py reads the price table).
STACKS_MAY_IMPORT = ("training.errors", "training.report.prices")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _owner(name: str) -> str | None:
    """The module of ours that ``name`` (a dotted import target) lives in, if any."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # annotations only: no runtime dependency
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


@cache
def import_graph() -> dict[str, frozenset[str]]:
    mods = modules()
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        deps = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            deps |= {owner for t in targets if (owner := _owner(t)) and owner != name}
        graph[name] = frozenset(deps)
    return graph


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    """The layer of a training module: that of its top-level name under training/."""
    unit = module.split(".")[1] if module.count(".") else ""
    for number, names in enumerate(LAYERS):
        if unit in names:
            return number
    raise AssertionError(f"{module}: training/{unit} is in no layer of tests/test_architecture.py LAYERS; "
                         "add it there and to ARCHITECTURE.md")


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_training_module_imports_a_layer_above_its_own():
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                    for m, deps in import_graph().items() if m.startswith("training.")
                    for d in deps if d.startswith("training.") and layer_of(d) > layer_of(m))
    assert upward == []


def test_the_model_and_data_layers_never_import_the_loop_perf_or_report():
    """The rule as the layering states it in one line, checked on its own."""
    higher = ("training.loop", "training.perf", "training.report", "training.config", "training.backends")
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items()
                 if m.startswith(("training.model", "training.data")) for d in deps if d.startswith(higher))
    assert bad == []


def test_stacks_import_only_the_torch_free_part_of_training():
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith("stacks")
                 for d in deps if d.startswith("training") and d not in STACKS_MAY_IMPORT)
    assert bad == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_the_size_limit(package):
    over = {str(p.relative_to(REPO)): n for name, p in modules().items() if name.split(".")[0] == package
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert over == {}, f"split by responsibility (CONTRIBUTING.md, 4): {over}"


def test_training_keeps_few_modules_at_its_top():
    top = sorted(p.name for p in (REPO / "training").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


# --------------------------------------------------------------------------- cited documents

#: an upper-case document name with its path, not inside a URL (a public page is cited by URL)
DOC_NAME = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
URL = re.compile(r"https?://\S+")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (REPO / line).is_file()]


def test_every_cited_document_is_in_the_repository():
    """A comment, docstring, script or doc that names an upper-case document (ARCHITECTURE.md,
    runbooks/README.md...) names one a new engineer can open from a clone."""
    files = _tracked_files()
    names = {Path(f).name for f in files} | set(files)
    missing = set()
    for rel in files:
        if not rel.endswith((".py", ".sh", ".sbatch", ".md", ".yaml", ".toml", ".txt", "Makefile", ".Dockerfile")):
            continue
        for cited in DOC_NAME.findall(URL.sub("", (REPO / rel).read_text(errors="replace"))):
            if cited not in names and cited.rsplit("/", 1)[-1] not in names:
                missing.add(f"{rel}: {cited}")
    assert sorted(missing) == []
