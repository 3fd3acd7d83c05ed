"""Config fields with their allowed values: `limit(default, ge=..., lt=...)` declares a
field's default and range beside it (`choices=` for a word from a fixed list), and
`check_limits` (called from each config section's `__post_init__`) enforces them and
finiteness, raising a ValueError that names `section.field` (the flag mapper turns it into
the flag)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field


def limit(default, *, ge=None, gt=None, le=None, lt=None, choices=None):
    """A field's default and the range its value must lie in, or the words it may be
    (checked by `check_limits`)."""
    metadata = {"limits": {">=": ge, ">": gt, "<=": le, "<": lt}}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata)


# Upper bounds on a model's shape: ~30x the largest published models (Llama 3.1 405B: 126
# layers, hidden 16384, FFN 53248, 128 heads, 128k context; DeepSeek-V3: 256 experts). Beyond
# them a value is a typo, and a memory estimate or a build would answer it with nonsense (the
# config and import-hf's reading of config.json hold them).
MAX_LAYERS, MAX_WIDTH, MAX_HEADS, MAX_SEQUENCE, MAX_EXPERTS = 4096, 1 << 20, 8192, 1 << 22, 1 << 14
# RoPE's base: ~300x the largest published (3.6e9, a 1M-context Llama 3); megatron-core raises
# it to a power as a torch integer, which overflows from 2**63
MAX_ROTARY_BASE = 10 ** 12

_HOLDS = {">=": lambda v, b: v >= b, ">": lambda v, b: v > b, "<=": lambda v, b: v <= b,
          "<": lambda v, b: v < b}


def check_limits(instance, section: str) -> None:
    """Every number of a config section finite and inside its field's limits, every word one
    of its choices; a ValueError names `section.field` (the flag mapper turns that into the
    flag)."""
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        choices = spec.metadata.get("choices")
        if choices is not None and value not in choices and \
                not (value is None and spec.default is None):  # an unset optional word
            raise ValueError(f"{section}.{spec.name} must be one of "
                             f"{', '.join(map(str, choices))}, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{spec.name} must be a finite number, got {value}")
        for relation, bound in spec.metadata.get("limits", {}).items():
            if bound is not None and not _HOLDS[relation](value, bound):
                raise ValueError(f"{section}.{spec.name} must be {relation} {bound}, got {value}")
