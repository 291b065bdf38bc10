"""The layering of the tree: the graph of imports between dmltrain's, shards' and cluster's modules has no loop, and
the run config's schema (``dmltrain.config``) imports nothing of the models.

Every import counts: at module level, inside a function (a lazy import is still a dependency), and under
``TYPE_CHECKING`` (a reader follows it just the same). Built from the source with ``ast``, nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dmltrain", "shards", "cluster")


def _modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its ``__init__``'s)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` loads last (``a.b.c`` may name a module or a name in ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` loads a.b when b is a module, else a
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_module_graph_has_no_loop():
    graph = import_graph()
    assert len(graph) > 100 and "dmltrain.distributed.sharded_softmax" in graph
    loop = _cycle(graph)
    assert loop is None, "import loop: " + " -> ".join(loop)


def test_the_config_schema_imports_no_model_code():
    """``dmltrain.config`` (and whatever it imports) reaches nothing under ``dmltrain.models``: the backbone's input
    contract comes from :mod:`dmltrain.backbone_facts`."""
    graph = import_graph()
    seen, todo = set(), ["dmltrain.config"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert not [m for m in graph["dmltrain.config"] if m.startswith("dmltrain.models")]
    assert not sorted(m for m in seen if m.startswith("dmltrain.models")), sorted(seen)


def test_the_loop_finder_finds_a_loop():
    """The check can fail: a planted loop (and an import inside a function counts)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    modules = {"p": ROOT / "x.py", "p.m": ROOT / "y.py", "p.n": ROOT / "z.py"}
    src = "def f():\n    from p.n import thing\n"
    tree_path = ROOT / "tests" / "_import_graph_probe.py"
    try:
        tree_path.write_text(src)
        assert _imports("p.m", tree_path, modules) == {"p.n"}
    finally:
        tree_path.unlink()
