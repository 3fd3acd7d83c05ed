"""Megatron's per-module precision config (`--te-precision-config-file`), read and written.

The format (megatron-core `extensions/TransformerEngineMixedPrecision.md`,
`quantization/quant_config.py`): named `configs` (a Transformer Engine quantization recipe
each; `training_recipe: {}` means no quantization, i.e. BF16) and ordered `matchers`; the
first *enabled* matcher whose glob (`fnmatch`) matches a module's path inside the GPTModel
(`decoder.layers.3.mlp.linear_fc2`) picks that module's config; a module no matcher picks
keeps the run's default precision.

Here a unit whose module picks a BF16 config runs the recovery path in every step (with
`--gnmr`, the controller's choices come on top); every other unit runs the recipe's low path,
whatever quantized config it picked (the recipe says how it quantizes). `write` produces the
file from a list of units, one exact-path matcher each, so the same selection drives a
Megatron/TE run and our static baseline.

Module paths: megatron names layers by their index within the pipeline stage and routed
experts by their index within the EP rank (`mlp.experts.local_experts.E`); the paths used
here are those of PP=1, EP=1, where both are global.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import yaml

from megatron_gnmr.errors import UserError

BF16_CONFIG = "bf16"


def module_path(unit: str) -> str:
    """`layers.3.mlp.experts.5.linear_fc1` -> `decoder.layers.3.mlp.experts.local_experts.5.
    linear_fc1` (PP=1, EP=1)."""
    return "decoder." + unit.replace(".mlp.experts.", ".mlp.experts.local_experts.")


def _load(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--precision-config-file {path}: no such file")
    try:
        document = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"--precision-config-file {path}: not valid YAML ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("matchers", {}), dict) \
            or not isinstance(document.get("configs", {}), dict):
        raise UserError(f"--precision-config-file {path}: expected mappings `configs:` and "
                        "`matchers:` (megatron's --te-precision-config-file format)")
    return document


def matchers(path: str, document: dict | None = None) -> list[tuple[str, str]]:
    """The enabled (pattern, config) matchers in order, checked as megatron checks them
    (`document`: the file's contents, if already read)."""
    document = _load(path) if document is None else document
    configs = document.get("configs") or {}
    found = []
    for name, matcher in (document.get("matchers") or {}).items():
        if not isinstance(matcher, dict):
            raise UserError(f"--precision-config-file {path}: matcher {name!r} is not a mapping")
        if not matcher.get("enabled", False):
            continue
        if matcher.get("type") != "glob":
            raise UserError(f"--precision-config-file {path}: matcher {name!r} has type "
                            f"{matcher.get('type')!r}; megatron implements glob only")
        pattern, config = matcher.get("pattern"), matcher.get("config")
        if not isinstance(pattern, str) or config not in configs:
            raise UserError(f"--precision-config-file {path}: matcher {name!r} needs a "
                            f"`pattern` and a `config` from configs ({', '.join(configs)})")
        found.append((pattern, config))
    return found


def is_high_precision(config: dict | None) -> bool:
    """A TE config that quantizes nothing (`training_recipe: {}`): BF16."""
    recipe = (config or {}).get("training_recipe")
    return isinstance(recipe, dict) and not recipe


def high_precision_units(path: str, units: list[str]) -> list[str]:
    """The units whose module's first enabled matcher picks a BF16 config."""
    document = _load(path)
    configs = document.get("configs") or {}
    ordered = matchers(path, document)
    chosen = []
    for unit in units:
        target = module_path(unit)
        config = next((config for pattern, config in ordered
                       if fnmatch.fnmatch(target, pattern)), None)
        if config is not None and is_high_precision(configs[config]):
            chosen.append(unit)
    return chosen


def write(path: str, units: list[str], note: str = "") -> None:
    """A megatron precision config keeping `units` in BF16, one exact matcher per unit."""
    document = {
        "configs": {BF16_CONFIG: {"transformer_engine_config_type": "TEQuantizationParams",
                                  "training_recipe": {}}},
        "matchers": {f"keep_{i}_bf16": {"config": BF16_CONFIG, "type": "glob",
                                        "pattern": module_path(unit), "enabled": True}
                     for i, unit in enumerate(units)},
    }
    header = "".join(f"# {line}\n" for line in note.splitlines())
    Path(path).write_text(header + yaml.safe_dump(document, sort_keys=False))


def kept_high(precision, units: list[str]) -> frozenset[str]:
    """The units a run's `--precision-config-file` keeps in BF16 (none without one)."""
    if not precision.precision_config_file:
        return frozenset()
    return frozenset(high_precision_units(precision.precision_config_file, units))
