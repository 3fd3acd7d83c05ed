"""The checkpoint format is one object per format (`checkpoints/formats.py`), asked by every
caller: no code outside that table compares a format's name (issue 60 item 1: it was 14
comparisons in 7 files, `choice.format == "torch_dist"` and the like).

The scan reads every module of the package (its syntax tree, so strings in comments and
docstrings do not count) and reports each comparison (`==`, `!=`, `in`, `not in`, a `match`
case) with a format's name on either side, alone or in a tuple, list or set.
"""

import ast
import dataclasses
from pathlib import Path

from megatron_gnmr.checkpoints.formats import FORMATS, checkpoint_format
from megatron_gnmr.config import CheckpointConfig

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gnmr"
TABLE = PACKAGE / "checkpoints" / "formats.py"
NOT_A_FORMAT = {
    # a pickle's module name that the data-only reader allows, not a checkpoint format
    ("checkpoints/torch_dist/data_only.py", 'module == "torch"'),
}


def _names_a_format(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_format(element, names) for element in node.elts)
    return False


def format_comparisons(package: Path, names: set[str]) -> list[str]:
    """`file:line: source` of every comparison of a format's name outside the table."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / TABLE.relative_to(PACKAGE):
            continue
        text = path.read_text()
        relative = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                operands = [node.value]
            else:
                continue
            if not any(_names_a_format(operand, names) for operand in operands):
                continue
            source = ast.get_source_segment(text, node)
            if (relative, source) not in NOT_A_FORMAT:
                found.append(f"{relative}:{node.lineno}: {source}")
    return found


def test_no_format_name_is_compared_outside_the_table():
    assert format_comparisons(PACKAGE, set(FORMATS)) == []


def test_a_planted_comparison_is_caught(tmp_path):
    """The scan above, on a package holding the comparisons the table replaced (and one
    allowed string that is no format, and the name in a docstring, which does not count)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "formats.py").write_text('NAME = "torch_dist" == "torch"\n')
    (tmp_path / "caller.py").write_text(
        '"""kind == "torch_dist" in prose"""\n'
        'def load(choice, kind, fmt):\n'
        '    if choice.format == "torch_dist":\n'
        '        pass\n'
        '    if "torch" != kind or kind in ("torch", "other"):\n'
        '        pass\n'
        '    match fmt:\n'
        '        case "torch_dist":\n'
        '            pass\n'
        '    return fmt == "tensorstore"\n')
    assert format_comparisons(tmp_path, set(FORMATS)) == [
        'caller.py:3: choice.format == "torch_dist"',
        'caller.py:5: "torch" != kind',
        'caller.py:5: kind in ("torch", "other")',
        'caller.py:8: "torch_dist"',
    ]


def test_every_format_the_config_accepts_is_in_the_table():
    """`--ckpt-format`'s choices (the config's) and the table name the same formats, and
    each entry is found by its name."""
    field = next(f for f in dataclasses.fields(CheckpointConfig) if f.name == "ckpt_format")
    choices = set(field.metadata["choices"])
    assert choices == set(FORMATS) == {"torch", "torch_dist"}
    for name in choices:
        assert checkpoint_format(name).name == name


def test_what_each_format_can_do():
    """Only megatron-core's dist_checkpointing format reshards and takes the sharded save's
    flags (--async-save, --ckpt-fully-parallel-load, the reshardable optimizer)."""
    assert {name: (f.reshards, f.sharded_save) for name, f in FORMATS.items()} == {
        "torch": (False, False), "torch_dist": (True, True)}
    assert checkpoint_format("torch").description == "meta.json"
    assert checkpoint_format("torch_dist").description == "megatron_gnmr.json"
