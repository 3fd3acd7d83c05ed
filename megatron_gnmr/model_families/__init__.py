"""The model families (`--model-family`): the registry.

A family (`model_families/base.py`'s `ModelFamily`) owns everything that depends on the
attention's shape: its unit linears and their GEMM shapes, the megatron spec and config, the
routing of its linears through a precision backend, the attention monitor's query and key
maps. A family with settings of its own declares them in its file
(a dataclass, `settings_section`) and `config.RunConfig` holds that section; they are
refused on another family's run. Adding a family is its file and one entry here.
"""

from __future__ import annotations

import dataclasses

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.base import ModelFamily, Route
from megatron_gnmr.model_families.deepseek_mla import DEEPSEEK_MLA
from megatron_gnmr.model_families.llama import LLAMA
from megatron_gnmr.platform import megatron_compat

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LLAMA, DEEPSEEK_MLA)}


def family_of(config) -> ModelFamily:
    """The family of a RunConfig's model, or a UserError naming the known ones."""
    try:
        return FAMILIES[config.model.model_family]
    except KeyError:
        raise UserError(f"--model-family {config.model.model_family!r}: use one of "
                        f"{', '.join(FAMILIES)}") from None


def hf_mapping(config, where: str):
    """The Hugging Face mapping of a RunConfig's family, the run checked against what its
    classes can express (a UserError names a family without one, or the setting)."""
    hf = getattr(family_of(config), "hf", None)  # a family may have no mapping
    if hf is None:
        readable = [name for family in FAMILIES.values() if getattr(family, "hf", None)
                    for name in family.hf.architectures]
        raise UserError(f"{where}: --model-family {config.model.model_family} has no Hugging "
                        f"Face mapping yet (the mappings built write {', '.join(readable)})")
    hf.exportable(config, where)
    return hf


def family_reading(hf_config: dict, where: str) -> ModelFamily:
    """The family whose Hugging Face mapping reads this config.json's class, or a UserError
    naming the classes that are read."""
    architectures = hf_config.get("architectures") or [hf_config.get("model_type")]
    mapped = [family for family in FAMILIES.values() if getattr(family, "hf", None)]
    for family in mapped:
        if set(family.hf.architectures) & set(architectures) or \
                hf_config.get("model_type") in family.hf.model_types:
            return family
    readable = [name for family in mapped for name in family.hf.architectures]
    raise UserError(f"{where}: architecture {architectures[0]!r} is not built here (import-hf "
                    f"reads {', '.join(readable)})")


def inapplicable_settings(config) -> list[tuple[str, str, str]]:
    """(section, field, family) of every setting of a family other than the run's that is
    set away from its default, in registry and field order."""
    chosen = family_of(config)
    found = []
    for family in FAMILIES.values():
        section = getattr(family, "settings_section", None)
        if family is chosen or section is None:
            continue
        settings = getattr(config, section)
        found += [(section, spec.name, family.name) for spec in dataclasses.fields(settings)
                  if getattr(settings, spec.name) != spec.default]
    return found


def route_unit_linears(spec, family: ModelFamily, route: Route):
    """A copy of a layer spec whose unit linears (the family's attention linears and the
    MLP's) are built from `route(megatron's class)`."""
    return megatron_compat.route_mlp_linears(family.route_attention_linears(spec, route), route)


def unit_linear_classes(spec, family: ModelFamily) -> dict[str, type]:
    """The classes a layer spec builds its unit linears from, by name (for checks and
    tests)."""
    return {**family.attention_linear_classes(spec), **megatron_compat.mlp_linear_classes(spec)}


def unit_linear_names(config) -> list[str]:
    """The last part of every unit linear's name in a RunConfig's model: the family's
    attention linears (those this model has), then the MLP's."""
    return [linear.name for linear in family_of(config).attention_linears(config)] + \
        list(megatron_compat.MLP_LINEARS)


def row_parallel_linears(config) -> set[str]:
    """The names of a model's row-parallel unit linears (the attention's output projection,
    the MLP's fc2)."""
    return {linear.name for linear in family_of(config).attention_linears(config)
            if linear.parallel == "row"} | {megatron_compat.MLP_LINEARS[1]}
