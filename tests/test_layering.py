"""The layering the README states: common at the bottom; broker, actor_node, learner_node, client and rewards beside
each other; envs, gateway, reliability and train above the client; ppoz on top. No import goes up or sideways, and no module
imports itself back through others (function-level imports count too: they are the same dependency, later)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "common": 0,
    "broker": 1,
    "actor_node": 1,
    "learner_node": 1,
    "client": 1,
    "rewards": 1,
    "envs": 2,
    "gateway": 2,
    "reliability": 2,
    "train": 2,
    "ppoz": 3,
}


def imports() -> dict[str, set[str]]:
    """module name -> the project modules it imports, anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
                    found |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
            graph[name] = {m for m in found if m.split(".")[0] in LAYERS}
    return graph


def test_no_import_goes_up_or_sideways():
    wrong = []
    for module, targets in imports().items():
        here = module.split(".")[0]
        for target in targets:
            there = target.split(".")[0]
            if there != here and LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = imports()
    known = set(graph)
    edges = {m: {t for t in ts if t in known and t != m} for m, ts in graph.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)
