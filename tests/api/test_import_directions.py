"""Imports run one way (DESIGN: "No folder imports one that imports it back"): no two modules of
usc import each other, at the top or inside a function, and no folder imports one that imports it
back. Read from the source with ``ast`` (nothing imported); imports under ``if TYPE_CHECKING`` run
never and do not count."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"usc": "usc", "dsl": "usc.dsl", "compiler": "usc.compiler", "passes": "usc.passes",
           "runtime": "usc.runtime"}
# Plan(text) parses its text, and the parser builds Plans: one value type and its parser, inside dsl/
KNOWN_PAIRS = {("usc.dsl.parser", "usc.dsl.plan")}
# The folders' order (DESIGN, "The flow"): each may import only those before it. The face (usc/)
# strings them together; usc.testing is the face's too.
LAYERS = ["usc.dsl", "usc.runtime", "usc.compiler", "usc.passes", "usc"]
# The executor refuses an optimizer that is not element-wise on sliced parameters with the
# compiler's CompileError (what users catch for "this model/plan cannot be compiled as asked")
KNOWN_BACK_EDGES = {("usc.runtime.optimizer_contract", "usc.compiler.errors")}


def module_files() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runs(node: ast.AST, parents: dict) -> bool:
    """Not under ``if TYPE_CHECKING:``."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return False
    return True


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    text = path.read_text()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)} \
        if "TYPE_CHECKING" in text else {}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and _runs(node, parents):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and _runs(node, parents):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in out if m in known and m != name}


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported(name, path, set(files)) for name, path in files.items()}


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert len(graph) > 100  # the scan found the tree
    pairs = {tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())}
    assert pairs == KNOWN_PAIRS


def layer(module: str) -> int:
    if module.startswith("usc.testing"):
        return len(LAYERS) - 1
    return next(i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + "."))


def test_no_folder_imports_one_that_imports_it_back():
    graph = import_graph()
    folders = {(layer(a), layer(b)) for a in graph for b in graph[a] if (a, b) not in KNOWN_BACK_EDGES}
    backward = {(LAYERS[a], LAYERS[b]) for a, b in folders if a < b and (b, a) in folders}
    assert not backward


def test_the_scan_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "plan.py"
    source.write_text("def f():\n    from .parser import parse_plan\n")
    assert imported("usc.dsl.plan", source, {"usc.dsl.parser"}) == {"usc.dsl.parser"}
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .parser import x\n")
    assert imported("usc.dsl.plan", source, {"usc.dsl.parser"}) == set()
