"""The package's shape: no import cycle (imports inside functions count), no product module that depends on
the benchmark, modules a reader can take in, a lean repair config, a strategy registry the engine obeys."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import kvboost_rag
from kvboost_rag.config import RepairConfig

PACKAGE = Path(kvboost_rag.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The kvboost_rag modules `path` imports, anywhere in it (a function's body included)."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvboost_rag")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.startswith("kvboost_rag"):
                # `from . import x` names a module when x is one
                found |= {f"{base}.{a.name}" if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).exists()
                          or (PACKAGE.parent / (f"{base}.{a.name}".replace(".", "/") + ".py")).exists() else base
                          for a in node.names}
    return found - {name}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {i for i in imports(path) if i in modules} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    edges = graph()
    # A package's __init__ importing its own submodules, which import siblings by full name, is no cycle of
    # behaviour; drop the edges from a submodule back to the package that contains it.
    for name in edges:
        edges[name] = {i for i in edges[name] if not name.startswith(i + ".")}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_product_module_depends_on_the_benchmark():
    edges = graph()
    users = {name for name, deps in edges.items() if any(d.startswith("kvboost_rag.bench") for d in deps)}
    allowed = {n for n in users if n.startswith(("kvboost_rag.bench", "kvboost_rag.cli.bench"))}
    assert users == allowed, sorted(users - allowed)


def test_modules_are_short_enough_to_read():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_repair_config_is_lean():
    assert len(dataclasses.fields(RepairConfig)) <= 8
    assert all(f.metadata.get("help") for f in dataclasses.fields(RepairConfig))  # the CLI's and LLMs' help


def test_the_engine_names_no_strategy_but_its_default():
    source = (PACKAGE / "engine.py").read_text()
    for name in ("prefix", "selective", "queryaware"):
        assert f'"{name}"' not in source, name
