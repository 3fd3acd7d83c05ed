"""The package's layers only point down, and no module imports itself back through others.

Every `import` counts, at module level or inside a function: a lazy import that reaches up a
layer is still an upward dependency. Layers, lowest first (docs/architecture.md):
"""

import ast
import pkgutil
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gnmr"
LAYERS = [
    {"errors", "platform", "limits", "jsonl"},
    {"data", "precision", "lora", "model_families"},
    {"controller"},
    {"monitors", "observe"},
    {"config"},
    {"model"},
    {"checkpoints"},
    {"training"},
    {"arguments", "input_files", "validation", "experiments", "estimate", "evaluation",
     "interop", "flag_table", "calibrate", "gpu_check"},
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


def upward_imports() -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                  if layer_of(b) > layer_of(a))


def test_every_import_points_down_or_sideways():
    upward = upward_imports()
    assert upward == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "megatron_gnmr" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "megatron_gnmr"


def test_a_planted_upward_import_is_caught(tmp_path, monkeypatch):
    """The machinery of the test above, on a package with upward imports planted in its
    lowest layer (an absolute one at module level, a relative one and a lazy one inside a
    function) beside downward and sideways ones that are allowed: a graph that missed an
    import form would pass the real package for nothing."""
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "errors.py": "import megatron_gnmr.cli\nfrom . import jsonl\n\n\n"
                     "def late():\n    from .training import loop\n",
        "jsonl.py": "from megatron_gnmr.errors import UserError\n",
        "cli.py": "from megatron_gnmr.training.loop import run\nimport megatron_gnmr.errors\n",
        "training/__init__.py": "",
        "training/loop.py": "from ..data import tokenizer\n",
        "data/__init__.py": "",
        "data/tokenizer.py": "def f():\n    from megatron_gnmr.config import RunConfig\n",
        "config.py": "",
    })
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "PACKAGE", package)
    monkeypatch.setattr(this, "KNOWN", set(modules()))
    assert upward_imports() == ["megatron_gnmr.data.tokenizer -> megatron_gnmr.config",
                                "megatron_gnmr.errors -> megatron_gnmr.cli",
                                "megatron_gnmr.errors -> megatron_gnmr.training.loop"]


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


def walked_modules(package: Path) -> set[str]:
    """Every module of the package as Python's import system lists it (pkgutil, package by
    package), not by the file search `modules()` makes."""
    found = {package.name}
    pending = [(package, package.name)]
    while pending:
        directory, prefix = pending.pop()
        for info in pkgutil.iter_modules([str(directory)]):
            found.add(f"{prefix}.{info.name}")
            if info.ispkg:
                pending.append((directory / info.name, f"{prefix}.{info.name}"))
    return found


def modules_in_no_layer(names: set[str]) -> list[str]:
    unplaced = []
    for name in sorted(names - {"megatron_gnmr"}):
        try:
            layer_of(name)
        except AssertionError:
            unplaced.append(name)
    return unplaced


def test_layer_table_knows_every_module():
    """Every module of the package has a layer, and the graph the tests above check holds
    every module (a module the file search missed would go unchecked)."""
    walked = walked_modules(PACKAGE)
    for name in ("megatron_gnmr.observe.report", "megatron_gnmr.monitors"):
        assert name in walked and layer_of(name) >= 0
    assert len(walked) > 100
    assert modules_in_no_layer(walked) == []
    assert walked == set(modules())


def test_a_module_in_no_layer_is_caught(tmp_path):
    """The check above, on a package with a top-level module and a subpackage the table
    does not name."""
    package = _write_package(tmp_path, {"__init__.py": "", "errors.py": "",
                                        "stray.py": "", "newpkg/__init__.py": "",
                                        "newpkg/part.py": "", "data/__init__.py": ""})
    assert modules_in_no_layer(walked_modules(package)) == [
        "megatron_gnmr.newpkg", "megatron_gnmr.newpkg.part", "megatron_gnmr.stray"]
