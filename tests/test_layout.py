"""The package's shape: no module of src/rlhflab takes part in an import cycle (imports inside
functions included), and the shared names have one home."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "rlhflab"


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = PACKAGE.parent) -> set[str]:
    """Every rlhflab module `path` imports, at any depth of the file (lazy imports count),
    except under `if TYPE_CHECKING:` (never executed). `from pkg import mod` counts mod."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # the module itself, or the nearest package that exists (importing a.b.c runs a and a.b too)
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in modules and candidate != this:
                    found.add(candidate)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def package_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports_of(f, modules) for f in files}
    # A package's __init__ runs before any of its submodules: importing a.b imports a.
    for name in list(graph):
        parent = name.rpartition(".")[0]
        if parent in graph and parent != "rlhflab":
            graph[name].add(parent)
    return graph


def test_no_module_takes_part_in_an_import_cycle():
    graph = package_graph()
    assert len(graph) > 30
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    """The check itself: a cycle closed by an import inside a function is found."""
    pkg = tmp_path / "rlhflab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from rlhflab import b\n")
    (pkg / "b.py").write_text("def f():\n    from rlhflab.a import x\n")
    modules = {"rlhflab", "rlhflab.a", "rlhflab.b"}
    graph = {"rlhflab": set(), **{f"rlhflab.{m}": imports_of(pkg / f"{m}.py", modules, tmp_path) for m in "ab"}}
    assert cycles(graph) == [["rlhflab.a", "rlhflab.b"]]


def test_layers_only_import_downwards():
    """Memory strategies, algorithms, rollouts and models never reach up into stages, lit or train."""
    graph = package_graph()
    upper = ("rlhflab.stages", "rlhflab.lit", "rlhflab.train", "rlhflab.config")
    lower = ("rlhflab.memory", "rlhflab.algos", "rlhflab.rollout", "rlhflab.models", "rlhflab.rewards", "rlhflab.tasks")
    for module, deps in graph.items():
        if module.startswith(lower):
            assert not [d for d in deps if d.startswith(upper)], module


def test_shared_constants_have_one_home():
    """The sweep plugin and the report import the package's names instead of copying them."""
    plugin = (ROOT / "plugins" / "hydra_plugins" / "rlhflab_mlflow" / "callback.py").read_text()
    report = (PACKAGE / "report.py").read_text()
    for text in (plugin, report):
        assert "from rlhflab.naming import" in text
        assert '"RLHFLAB_MLFLOW_PARENT_RUN_ID"' not in text and '= "rlhflab.sweep"' not in text


def test_every_field_of_every_option_file_has_its_comment():
    """The README says so of the option files (conf/<group>/, not the presets, which say what they set in their
    header); the hub model presets had none on most fields."""
    missing = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        if path.relative_to(ROOT / "conf").parts[0] in ("experiment", "debug", "hydra") or path.parent == ROOT / "conf":
            continue
        block = None  # the mapping a line is in: model.arch's keys are a transformers config's, documented there
        for number, line in enumerate(path.read_text().splitlines(), 1):
            key = re.match(r"^(\s*)([A-Za-z][\w.]*):", line)
            if not key:
                continue
            if not key[1]:
                block = key[2]
            if key[2] != "defaults" and "#" not in line and not (key[1] and block == "arch"):
                missing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not missing, "\n".join(missing)
