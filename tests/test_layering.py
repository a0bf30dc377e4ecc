"""The layering the README states: common (the contracts between processes) at the bottom, the model code above it;
broker, actor_node, learner_node, client and rewards beside each other; envs, gateway and dataset_driver above the
client; ppoz's commands above them; the tools (benchmarks, fuzzer, soak, farm) above the commands they start; and the
command line's dispatcher, ppoz.cli, on top. No import goes up or sideways, and no module imports itself back through
others (function-level imports count too: they are the same dependency, later)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A layer by package, or by module where a package has a part above another (the longest name that matches wins).
LAYERS = {
    "common": 0,
    "models": 1,
    "broker": 2,
    "actor_node": 2,
    "learner_node": 2,
    "client": 2,
    "rewards": 2,
    "envs": 3,
    "gateway": 3,
    "dataset_driver": 3,
    "ppoz": 4,
    "tools": 5,
    "ppoz.cli": 6,
}


def layer_of(module: str) -> tuple[str, int]:
    """The part a module belongs to and its layer: its longest prefix in LAYERS."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS:
            return name, LAYERS[name]
    raise KeyError(module)


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
        here, here_layer = layer_of(module)
        for target in targets:
            there, there_layer = layer_of(target)
            if there != here and there_layer >= here_layer:
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
