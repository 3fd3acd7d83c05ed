"""The command line: Megatron-style flags and YAML files mapped onto `config.RunConfig`.

Flags are generated from the config dataclasses, so every field is settable both ways and
has exactly one default. Precedence: dataclass default < YAML (`--config`) < flags.
Every mistake is raised as a UserError naming the flag, key or file at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path

import yaml

from megatron_gnmr.config import SECTIONS, RunConfig, flag_name, moved_section
from megatron_gnmr.errors import UserError


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _base_type(annotation) -> type:
    """int / float / str / bool out of Optional[...] and friends (schedules are strings);
    `list[str]` fields are `list` (a flag taking one or more values)."""
    if typing.get_origin(annotation) is list:
        return list
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return _base_type(args[0])
    return annotation if annotation in (int, float, str, bool) else str


def _fields(section: str):
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        yield f, _base_type(hints[f.name]), docs.get(f.name, "")


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field, for --help."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
                if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    docs[node.target.id] = after.value.value.strip()
    return docs


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError: one line and exit 2, no usage dump."""

    def error(self, message: str):
        raise UserError(f"{message} (see --help)")


def build_parser(prog: str = "pretrain_llama.py") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, allow_abbrev=False, description="LLaMA pretraining on megatron-core with GNMR.")
    parser.add_argument("--config", help="YAML file with sections: " + ", ".join(SECTIONS))
    for section in SECTIONS:
        group = parser.add_argument_group(section)
        for f, kind, doc in _fields(section):
            flag, dest = flag_name(section, f.name), f"{section}.{f.name}"
            help_text = doc.replace("%", "%%")
            if kind is bool and f.name.startswith("no_"):
                # argparse's --X/--no-X pair would read `--no-load-optim` as its "no" form:
                # False. A negative name is a switch that only turns on.
                group.add_argument(flag, dest=dest, action="store_true",
                                   default=argparse.SUPPRESS, help=help_text)
            elif kind is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            elif kind is list:
                group.add_argument(flag, dest=dest, nargs="+", default=argparse.SUPPRESS,
                                   metavar=f.metadata.get("metavar", "VALUE"), help=help_text)
            else:
                parse = _number if f.name == "max_o" else kind
                group.add_argument(flag, dest=dest, type=parse, default=argparse.SUPPRESS,
                                   metavar=kind.__name__.upper(), help=help_text)
    return parser


def _check_yaml_value(path: str, section: str, name: str, value, kind: type, optional: bool):
    if value is None and optional:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value) if name != "max_o" else value
    if kind is str and section == "gnmr" and name.endswith("_schedule"):
        return value
    if kind is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{path}: {section}.{name} must be a list of strings, got {value!r}")
        return value
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise UserError(
            f"{path}: {section}.{name} must be {kind.__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def _load_yaml(path: str) -> dict[str, dict]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserError(f"--config {path}: not valid YAML ({str(error).splitlines()[0]})")
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: the top level must be a mapping of sections")
    values: dict[str, dict] = {}
    for section, entries in data.items():
        if section not in SECTIONS:
            hint = difflib.get_close_matches(str(section), SECTIONS, n=1)
            raise UserError(
                f"{path}: unknown section {section!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else f"; known: {', '.join(SECTIONS)}")
            )
        if not isinstance(entries, dict):
            raise UserError(f"{path}: section {section!r} must be a mapping")
        for name, value in entries.items():
            section_now = moved_section(section, name)
            if section_now != section:
                print(f"notice: {path}: {section}.{name} is read as {section_now}.{name} "
                      f"(its section now); move it there", file=sys.stderr)
            known = {f.name: (f, kind) for f, kind, _ in _fields(section_now)}
            if name not in known:
                hint = difflib.get_close_matches(str(name), known, n=1)
                raise UserError(
                    f"{path}: unknown key {section_now}.{name}"
                    + (f" (did you mean {section_now}.{hint[0]}?)" if hint else "")
                )
            f, kind = known[name]
            optional = f.default is None
            values.setdefault(section_now, {})[name] = _check_yaml_value(
                path, section_now, name, value, kind, optional
            )
    return values


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 announce: bool = True) -> RunConfig:
    """Parse flags (ours and Megatron-LM's, `interop/megatron_flags.py`; and the YAML they
    name) into a validated RunConfig. A flag left out means what it means in Megatron-LM
    (`interop/megatron_defaults.py`): the global batch is one micro-batch per data-parallel
    rank of a launch of `world_size` processes (default: this launch's). With `announce`, the
    logging rank says once where this run's absent flags differ from Megatron-LM's."""
    from megatron_gnmr.config import launch_world_size
    from megatron_gnmr.interop.megatron_flags import check_family, translate

    parser = build_parser()
    ours = frozenset(name for action in parser._actions for name in action.option_strings)
    argv = list(sys.argv[1:] if argv is None else argv)
    translation = translate(argv, ours)
    namespace = vars(parser.parse_args(translation.argv))
    values = _load_yaml(namespace.pop("config")) if namespace.get("config") else {}
    namespace.pop("config", None)
    for dest, value in namespace.items():
        section, name = dest.split(".", 1)
        values.setdefault(section, {})[name] = value
    if values.get("checkpoint", {}).get("use_checkpoint_args"):
        _from_the_checkpoint(values)
    _global_batch(values, launch_world_size() if world_size is None else world_size)
    sections = {}
    for section, cls in SECTIONS.items():
        try:
            sections[section] = cls(**values.get(section, {}))
        except ValueError as error:
            raise UserError(_name_the_flag(str(error))) from None
    config = RunConfig(**sections)
    check_family(translation, config.model.model_family)
    if announce:
        given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        _say_once(config, given | {flag_name(section, name) for section, fields in
                                   values.items() for name in fields})
    return config


def _global_batch(values: dict[str, dict], world_size: int) -> None:
    """Megatron-LM's --global-batch-size when absent: --micro-batch-size x the data-parallel
    size of the launch."""
    training, parallel = values.setdefault("training", {}), values.get("parallel", {})
    if training.get("global_batch_size") is not None:
        return
    defaults = {f.name: f.default for section in ("parallel", "training")
                for f in dataclasses.fields(SECTIONS[section])}
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        size = parallel.get(name, defaults[name])
        model_parallel *= size if isinstance(size, int) and size >= 1 else 1
    micro = training.get("micro_batch_size", defaults["micro_batch_size"])
    if isinstance(micro, int) and micro >= 1:
        training["global_batch_size"] = micro * max(1, world_size // model_parallel)


def _say_once(config: RunConfig, given: set[str]) -> None:
    """The start notice, from the logging rank only (`interop/start_notice.py`)."""
    import os

    from megatron_gnmr.interop.start_notice import start_notices

    if os.environ.get("RANK", "0") != "0":
        return
    for line in start_notices(config, given):
        print(f"notice: {line}", file=sys.stderr)


# Megatron-LM's --use-checkpoint-args: the sections that describe the model's shape
MODEL_SECTIONS = ("model", "mla")


def _from_the_checkpoint(values: dict[str, dict]) -> None:
    """--use-checkpoint-args: every model setting --load's checkpoint recorded, unless given
    (YAML or flag); one given that disagrees with it is refused, naming both."""
    from megatron_gnmr.checkpoints.choice import recorded_settings

    checkpoint = values["checkpoint"]
    load = checkpoint.get("load")
    if load is None:
        raise UserError("--use-checkpoint-args reads the model from --load's checkpoint: give "
                        "--load")
    directory, recorded = recorded_settings(load, checkpoint.get("ckpt_step"))
    for section in MODEL_SECTIONS:
        for f, _, _ in _fields(section):
            flag = flag_name(section, f.name)
            if flag not in recorded:
                continue
            given = values.get(section, {}).get(f.name, recorded[flag])
            if given != recorded[flag]:
                raise UserError(f"{flag} {given} disagrees with {directory}'s {flag} "
                                f"{recorded[flag]} (--use-checkpoint-args reads the model from "
                                "the checkpoint: drop one)")
            values.setdefault(section, {})[f.name] = recorded[flag]


def _name_the_flag(message: str) -> str:
    """`gnmr.alpha must ...` (a config section's check) -> `--gnmr-alpha (YAML gnmr.alpha)
    must ...`: the user may have set it either way."""
    key, _, rest = message.partition(" ")
    section, _, name = key.partition(".")
    if section in SECTIONS and name and name.isidentifier():
        return f"{flag_name(section, name)} (YAML {key}) {rest}"
    return f"{message} (see --help)"
