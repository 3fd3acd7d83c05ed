"""Megatron's per-module precision config (`--te-precision-config-file`), read as megatron-core
reads it, and written.

The format (megatron-core `extensions/TransformerEngineMixedPrecision.md`,
`quantization/quant_config.py`): named `configs` and ordered `matchers`. Every module with a
quantization override (the TE linears: our units' modules) asks the matchers in order; the
first *enabled* one whose glob (`fnmatch`) matches the module's path inside the GPTModel
(`decoder.layers.3.mlp.linear_fc2`) picks the config by name, and megatron parses that config
as `TEQuantizationParams` (`extensions/transformer_engine.py`: `finish_init`). A module no
matcher picks keeps the run's default precision; a config no module picks is never parsed.

Read in megatron-core 0.16.1 and 0.19.2 (the same code); what megatron refuses, we refuse
before anything is built, with one line naming the file, the matcher or config, and the key:
- a matcher: `type` missing or not `glob`; `pattern` or `config` missing (checked for enabled
  matchers only, as megatron); a picked config that `configs` does not have;
- a picked config: `transformer_engine_config_type` missing or not `TEQuantizationParams`;
  `training_recipe` missing; keys besides it and `evaluation_recipe`; in a recipe, a key that
  `TEQuantizationRecipe` does not have, a delayed-scaling recipe, FP8 and FP4 together, a
  custom recipe without its factory; and what megatron checks at the first forward
  (`_get_fp8_autocast_for_quant_recipe`): an unknown FP8 or FP4 recipe name, an FP8 format
  other than e4m3/hybrid.
Beyond megatron (it would fail on these with a traceback, or not at all): a file that is not
YAML text, or whose `configs` / `matchers` are not mappings of mappings.

What a picked config means (`_get_fp8_autocast_for_quant_recipe`): a training recipe with no
FP8 and no FP4 recipe forces BF16, whatever other options it sets, unless it says
`override_quantized_autocast: false` (then the module keeps the run's quantized precision).
Here a unit whose module is forced to BF16 runs the recovery path in every step (with
`--gnmr`, the controller's choices come on top); every other unit runs the recipe's low path
(the recipe says how it quantizes). `write` produces the file from a list of units, one
exact-path matcher each, so the same selection drives a Megatron/TE run and our static rule.

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
CONFIG_TYPE_KEY = "transformer_engine_config_type"
CONFIG_TYPES = ("TEQuantizationParams",)
CONFIG_KEYS = {CONFIG_TYPE_KEY, "training_recipe", "evaluation_recipe"}
# megatron's TEQuantizationRecipe fields (0.16.1 = 0.19.2) and the names its forward accepts
RECIPE_KEYS = {"fp8_quantization_recipe", "fp4_quantization_recipe", "custom_recipe_factory",
               "fp8_format", "override_quantized_autocast", "override_nonquantized_autocast",
               "tp_only_amax_red"}
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8", "custom")  # `delayed`: refused by megatron
FP4_RECIPES = ("nvfp4", "custom")
FP8_FORMATS = ("e4m3", "hybrid")


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
    except UnicodeDecodeError:
        raise UserError(f"--precision-config-file {path}: not a text file (a YAML "
                        "precision config was expected)") from None
    except yaml.YAMLError as error:
        raise UserError(f"--precision-config-file {path}: not valid YAML "
                        f"({str(error).splitlines()[0]})") from None
    if not isinstance(document, dict):
        raise UserError(f"--precision-config-file {path}: expected mappings `configs:` and "
                        "`matchers:` (megatron's --te-precision-config-file format)")
    for section in ("configs", "matchers"):
        entries = document.get(section) or {}
        bad = [name for name, value in entries.items() if not isinstance(value, dict)] \
            if isinstance(entries, dict) else None
        if bad is None or bad:
            where = f" ({section} {bad[0]!r} is not a mapping)" if bad else ""
            raise UserError(f"--precision-config-file {path}: `{section}:` must map names to "
                            f"mappings{where}")
    return document


def matchers(path: str, document: dict | None = None) -> list[tuple[str, str]]:
    """The enabled (pattern, config) matchers in order, checked as megatron checks them
    (`document`: the file's contents, if already read)."""
    document = _load(path) if document is None else document
    found = []
    for name, matcher in (document.get("matchers") or {}).items():
        if not matcher.get("enabled", False):
            continue
        where = f"--precision-config-file {path}: matcher {name!r}"
        if matcher.get("type") is None:
            raise UserError(f"{where}: `type` is missing (megatron implements glob)")
        if matcher["type"] != "glob":
            raise UserError(f"{where}: type {matcher['type']!r}; megatron implements glob only")
        for key in ("pattern", "config"):
            if matcher.get(key) is None:
                raise UserError(f"{where}: `{key}` is missing")
        if not isinstance(matcher["pattern"], str):
            raise UserError(f"{where}: `pattern` must be a glob string, got "
                            f"{matcher['pattern']!r}")
        found.append((matcher["pattern"], matcher["config"]))
    return found


def _check_recipe(where: str, recipe) -> None:
    """A TEQuantizationRecipe as megatron parses it and its forward reads it."""
    if not isinstance(recipe, dict):
        raise UserError(f"{where}: must be a mapping of recipe options, got {recipe!r}")
    unknown = sorted(set(recipe) - RECIPE_KEYS, key=str)
    if unknown:
        raise UserError(f"{where}: key {unknown[0]!r} is not a TEQuantizationRecipe option "
                        f"(use {', '.join(sorted(RECIPE_KEYS))})")
    fp8, fp4 = recipe.get("fp8_quantization_recipe"), recipe.get("fp4_quantization_recipe")
    if fp8 == "delayed":
        raise UserError(f"{where}: fp8_quantization_recipe 'delayed': delayed scaling is not "
                        "in scope of megatron's per-module quantization config")
    if fp8 is not None and fp4 is not None:
        raise UserError(f"{where}: fp8_quantization_recipe and fp4_quantization_recipe are "
                        "mutually exclusive")
    # the format is read only for a non-custom FP8 recipe (megatron's forward)
    fp8_format = recipe.get("fp8_format", "e4m3") if fp8 not in (None, "custom") else None
    for key, value, allowed in (("fp8_quantization_recipe", fp8, FP8_RECIPES),
                                ("fp4_quantization_recipe", fp4, FP4_RECIPES),
                                ("fp8_format", fp8_format, FP8_FORMATS)):
        if value is not None and value not in allowed:
            raise UserError(f"{where}: {key} {value!r} is not one of {', '.join(allowed)}")
    if "custom" in (fp8, fp4) and recipe.get("custom_recipe_factory") is None:
        raise UserError(f"{where}: a custom recipe needs custom_recipe_factory")


def _forces_bf16(path: str, name: str, config: dict) -> bool:
    """Parse a picked config as megatron's TEQuantizationParams; True when its training recipe
    runs the module in BF16 inside the run's quantized autocast."""
    where = f"--precision-config-file {path}: config {name!r}"
    if CONFIG_TYPE_KEY not in config:
        raise UserError(f"{where}: `{CONFIG_TYPE_KEY}` is missing (use TEQuantizationParams)")
    if config[CONFIG_TYPE_KEY] not in CONFIG_TYPES:
        raise UserError(f"{where}: {CONFIG_TYPE_KEY} {config[CONFIG_TYPE_KEY]!r} is not "
                        f"supported (use {', '.join(CONFIG_TYPES)})")
    if "training_recipe" not in config:
        raise UserError(f"{where}: `training_recipe` is missing")
    extra = sorted(set(config) - CONFIG_KEYS, key=str)
    if extra:
        raise UserError(f"{where}: key {extra[0]!r} is not allowed (a config has "
                        f"{', '.join(sorted(CONFIG_KEYS))})")
    for key in ("training_recipe", "evaluation_recipe"):
        if key in config:
            _check_recipe(f"{where}, {key}", config[key])
    training = config["training_recipe"]
    quantizes = training.get("fp8_quantization_recipe") is not None or \
        training.get("fp4_quantization_recipe") is not None
    return not quantizes and bool(training.get("override_quantized_autocast", True))


def high_precision_units(path: str, units: list[str]) -> list[str]:
    """The units whose module's first enabled matcher picks a config that forces BF16; every
    picked config is checked as megatron parses it (UserError naming file, config, key)."""
    document = _load(path)
    configs = document.get("configs") or {}
    ordered = matchers(path, document)
    verdicts: dict[str, bool] = {}
    chosen = []
    for unit in units:
        target = module_path(unit)
        config = next((config for pattern, config in ordered
                       if fnmatch.fnmatch(target, pattern)), None)
        if config is None:
            continue
        if config not in configs:
            raise UserError(f"--precision-config-file {path}: a matcher picks config "
                            f"{config!r} for {target}, which `configs:` does not have "
                            f"({', '.join(map(str, configs)) or 'none'})")
        if config not in verdicts:
            verdicts[config] = _forces_bf16(path, config, configs[config])
        if verdicts[config]:
            chosen.append(unit)
    return chosen


def write(path: str, units: list[str], note: str = "") -> None:
    """A megatron precision config keeping `units` in BF16, one exact matcher per unit."""
    document = {
        "configs": {BF16_CONFIG: {CONFIG_TYPE_KEY: "TEQuantizationParams",
                                  "training_recipe": {}}},
        "matchers": {f"keep_{i}_bf16": {"config": BF16_CONFIG, "type": "glob",
                                        "pattern": module_path(unit), "enabled": True}
                     for i, unit in enumerate(units)},
    }
    header = "".join(f"# {line}\n" for line in note.splitlines())
    Path(path).write_text(header + yaml.safe_dump(document, sort_keys=False))


def file_units(unit_names: list[str]) -> list[str]:
    """The units a precision config can address: the TE linears' (not a core attention)."""
    return [name for name in unit_names if not name.endswith(".core_attention")]
