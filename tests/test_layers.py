"""The package's layout stays true: no import circles, and imports only point downwards.

Layers, bottom to top, as docs/concepts.md and each folder's docstring say. A module may import its own unit
(the folder it is in) and any unit of a lower layer; never a unit beside it in the same layer, nor one above.
Every import counts, including those inside functions and under TYPE_CHECKING: a lazy import is still a
dependency, and lazy imports were how the old llm modules came to import each other in a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rljob"

LAYERS: list[tuple[str, ...]] = [
    ("rljob.api",),
    ("rljob.algorithms",),
    ("rljob.runtime.process", "rljob.runtime.records"),
    ("rljob.runtime.wire",),
    ("rljob.runtime.sandbox", "rljob.runtime.weights", "rljob.runtime.optim"),
    ("rljob.runtime.gym", "rljob.runtime.llm"),
    ("rljob.runtime.vla",),
    ("rljob.runtime.roles", "rljob.runtime.preflight"),
    ("rljob.launch",),
    ("rljob.operator",),
    ("rljob.cli",),
]
"""The package's layers; `rljob` itself (the version) is importable from anywhere."""

LLM_LAYERS: list[tuple[str, ...]] = [
    ("rljob.runtime.llm.data", "rljob.runtime.llm.models", "rljob.runtime.llm.replicas"),
    ("rljob.runtime.llm.engines",),
    ("rljob.runtime.llm.episodes",),
    ("rljob.runtime.llm.training",),
    ("rljob.runtime.llm",),
]
"""Inside `rljob.runtime.llm`: its folders, bottom to top; the loops at `llm/`'s own level are on top."""


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The rljob modules `name` imports (the deepest known module of each imported name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("rljob") and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: set(imports_of(name, path, set(modules))) for name, path in modules.items()}


def unit_of(module: str, layers: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """(layer index, unit) of the most specific unit holding `module`, or None when no unit holds it."""
    found = [
        (i, unit) for i, units in enumerate(layers) for unit in units if module == unit or module.startswith(unit + ".")
    ]
    return max(found, key=lambda found_unit: len(found_unit[1])) if found else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if target == "rljob":
                continue
            for layers in (LAYERS, LLM_LAYERS):
                here, there = unit_of(module, layers), unit_of(target, layers)
                if here is None or there is None or here[1] == there[1]:
                    continue
                if there[0] > here[0]:
                    problems.append(f"{module} imports {target}: upward ({here[1]} is below {there[1]})")
                elif there[0] == here[0]:
                    problems.append(f"{module} imports {target}: sideways ({here[1]} and {there[1]} are siblings)")
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_another_in_a_circle() -> None:
    assert circles(import_graph()) == []


def test_imports_point_only_downwards() -> None:
    assert layer_violations(import_graph()) == []


def test_every_module_has_a_layer() -> None:
    """A new top-level package or runtime room must be placed in LAYERS (and in docs/concepts.md)."""
    homeless = [m for m in module_names() if m not in ("rljob", "rljob.runtime") and unit_of(m, LAYERS) is None]
    assert homeless == []


def test_every_runtime_folder_says_what_it_is_for_and_what_it_may_import() -> None:
    runtime = PACKAGE / "runtime"
    folders = [p for p in runtime.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    undocumented = []
    for folder in folders:
        init = folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        if not doc or "import" not in doc.lower():
            undocumented.append(str(folder.relative_to(PACKAGE.parent)))
    assert undocumented == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        # The old llm layout: engine -> setup -> sft -> multiturn -> engine.
        (
            {
                "rljob.runtime.llm.engine": {"rljob.runtime.llm.setup"},
                "rljob.runtime.llm.setup": {"rljob.runtime.llm.sft"},
                "rljob.runtime.llm.sft": {"rljob.runtime.llm.multiturn"},
                "rljob.runtime.llm.multiturn": {"rljob.runtime.llm.engine"},
            },
            [
                [
                    "rljob.runtime.llm.engine",
                    "rljob.runtime.llm.multiturn",
                    "rljob.runtime.llm.setup",
                    "rljob.runtime.llm.sft",
                ]
            ],
        ),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_circle_check_finds_a_circle(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(graph) == expected


@pytest.mark.parametrize(
    ("module", "target", "kind"),
    [
        ("rljob.runtime.wire.context", "rljob.runtime.roles", "upward"),  # the old roles.common <- divergence
        ("rljob.runtime.llm.engines.base", "rljob.runtime.llm.setup", "upward"),
        ("rljob.runtime.llm.engines.hf", "rljob.runtime.llm.training.learner", "upward"),
        ("rljob.runtime.gym.actor", "rljob.runtime.llm.training.learner", "sideways"),
        ("rljob.runtime.weights.sync", "rljob.runtime.sandbox.runner", "sideways"),
        ("rljob.api.spec", "rljob.runtime.wire.identity", "upward"),
        ("rljob.runtime.wire.identity", "rljob.operator.naming", "upward"),
    ],
)
def test_the_layer_check_refuses_upward_and_sideways_imports(module: str, target: str, kind: str) -> None:
    (problem,) = layer_violations({module: {target}})
    assert kind in problem and module in problem and target in problem


def test_the_layer_check_allows_downward_and_same_folder_imports() -> None:
    graph = {
        "rljob.runtime.llm.actor": {"rljob.runtime.llm.training.learner", "rljob.runtime.wire.transport"},
        "rljob.runtime.llm.training.sft": {
            "rljob.runtime.llm.episodes.multiturn",
            "rljob.runtime.llm.training.learner",
        },
        "rljob.operator.reconcile": {"rljob.launch.failure_policy", "rljob.api"},
        "rljob.cli.main": {"rljob"},
    }
    assert layer_violations(graph) == []
