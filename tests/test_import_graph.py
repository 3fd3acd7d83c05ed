"""The package's layers only point down, and no module imports itself back through others.

Every `import` counts, at module level or inside a function: a lazy import that reaches up a
layer is still an upward dependency. Layers, lowest first (docs/architecture.md):
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gnmr"
LAYERS = [
    {"errors", "platform", "limits", "jsonl"},
    {"data", "precision", "lora", "model_families"},
    {"controller"},
    {"monitors", "observe"},
    {"config"},
    {"model"},
    {"training"},
    {"arguments", "input_files", "validation", "experiments", "estimate", "evaluation",
     "interop", "flag_table"},
    {"cli"},
]
__doc__ += "\n".join(f"{rank}: {', '.join(sorted(names))}" for rank, names in enumerate(LAYERS))


def layer_of(module: str) -> int:
    top = module.split(".")[1]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & KNOWN
            # `from package import submodule` depends on the submodule, not the package
            found.update(submodules or {base})
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" not in KNOWN and base in KNOWN)
    return {i for i in found if i.startswith("megatron_gnmr.")}


KNOWN = set(modules())


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {i for i in imports(name, path) if i in known and i != name}
            for name, path in known.items() if name != "megatron_gnmr"}


def test_every_import_points_down_or_sideways():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if layer_of(b) > layer_of(a)]
    assert upward == []


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_two_packages_import_each_other():
    """Sideways imports within a layer point one way: no package-level cycle (precision
    and model_families once imported each other, inside functions)."""
    def package(module: str) -> str:
        return module.split(".")[1]

    edges = {(package(a), package(b)) for a, targets in graph().items() for b in targets
             if package(a) != package(b)}
    assert sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b) == []


@pytest.mark.parametrize("name", ["megatron_gnmr.observe.report", "megatron_gnmr.monitors"])
def test_layer_table_knows_every_module(name):
    assert layer_of(name) >= 0
