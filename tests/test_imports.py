"""The package's import graph, read with ast from every module of tabfm/, parallel/ and data/.

- No cycle among the imports a module runs when it is imported (module level, class bodies, and `if TYPE_CHECKING:`
  blocks, which are a dependency even if Python skips them). An import inside a function runs later, when the
  module is complete (that is how a module defers a heavy import), and one under `if __name__ == "__main__":`
  only when it runs as a script: neither makes an import cycle.
- The model (model.py, inference.py, blocks.py) is plain one-device code: nothing it imports anywhere, directly or
  through another module, is in tabfm.parallel.
- Dependencies point one way (DESIGN 2: tabfm -> tabfm.parallel, tabfm -> tabfm.data): the parallel package reads
  only the plain blocks from tabfm (tabfm.blocks, re-exported as tabfm.parallel.dense); data reads nothing of the
  others. Imports anywhere in a module count here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"tabfm": ROOT / "tabfm", "tabfm.parallel": ROOT / "parallel", "tabfm.data": ROOT / "data"}
PLAIN = ("tabfm.model", "tabfm.inference", "tabfm.blocks")
"""The one-device model: none of these may reach tabfm.parallel, directly or through another module."""


def _modules() -> dict[str, Path]:
    """Every module of the three folders by its dotted name (a package by its own name)."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module, or a module's attribute) names; None when it is not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_main_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`"""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"')


def _nodes(tree: ast.AST, eager: bool) -> list[ast.AST]:
    """Every node of the tree; with `eager`, not those inside function bodies (they run when called) or under
    `if __name__ == "__main__":` (it runs when the module is a script)."""
    if not eager:
        return list(ast.walk(tree))
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and not _is_main_block(node):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(module: str, path: Path, modules: dict[str, Path], eager: bool = False) -> set[str]:
    """The modules of ours that `module` imports: anywhere in its source, or (eager) when it is imported."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text(), str(path)), eager):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import mod` imports pkg.mod
        else:
            continue
        found |= {m for n in names if (m := _resolve(n, modules)) is not None and m != module}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Every import anywhere in each module."""
    modules = _modules()
    assert {"tabfm.model", "tabfm.inference", "tabfm.parallel.parallelize", "tabfm.data.encode"} <= set(modules)
    return {m: _imports(m, p, modules) for m, p in modules.items()}


@pytest.fixture(scope="module")
def eager_graph() -> dict[str, set[str]]:
    """The imports each module runs when it is imported."""
    modules = _modules()
    return {m: _imports(m, p, modules, eager=True) for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_the_package_has_no_import_cycle(eager_graph):
    cycle = _cycle(eager_graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_type_checking_imports_count_and_deferred_ones_do_not(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                    "class A:\n    from pkg import c\n    def f(self):\n        from pkg.d import D\n"
                    "if __name__ == '__main__':\n    import pkg.e\n")
    modules = {name: path for name in ("pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e")}
    assert _imports("pkg.a", path, modules, eager=True) == {"pkg.b", "pkg.c"}
    assert _imports("pkg.a", path, modules) == {"pkg.b", "pkg.c", "pkg.d", "pkg.e"}


@pytest.mark.parametrize("module", PLAIN)
def test_the_model_is_plain_one_device_code(graph, module):
    parallel = sorted(m for m in _reach(graph, module) if _within(m, "tabfm.parallel"))
    assert not parallel, f"{module} reaches the parallel package: {parallel}"


def test_dependencies_point_one_way(graph):
    bad = []
    for m, deps in graph.items():
        for d in deps:
            if _within(m, "tabfm.parallel") and not (_within(d, "tabfm.parallel") or d == "tabfm.blocks"):
                bad.append(f"{m} -> {d}")  # the parallel package may read the plain blocks, nothing else of tabfm
            if _within(m, "tabfm.data") and not _within(d, "tabfm.data"):
                bad.append(f"{m} -> {d}")
    assert not bad, bad
