"""Config fields with their allowed range: `limit(default, ge=..., lt=...)` declares a
field's default and range beside it, and `check_limits` (called from each config section's
`__post_init__`) enforces them and finiteness, raising a ValueError that names
`section.field` (the flag mapper turns it into the flag)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field


def limit(default, *, ge=None, gt=None, le=None, lt=None):
    """A field's default and the range its value must lie in (checked by `check_limits`)."""
    return field(default=default, metadata={"limits": {">=": ge, ">": gt, "<=": le, "<": lt}})


_HOLDS = {">=": lambda v, b: v >= b, ">": lambda v, b: v > b, "<=": lambda v, b: v <= b,
          "<": lambda v, b: v < b}


def check_limits(instance, section: str) -> None:
    """Every number of a config section finite and inside its field's limits; a ValueError
    names `section.field` (the flag mapper turns that into the flag)."""
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{spec.name} must be a finite number, got {value}")
        for relation, bound in spec.metadata.get("limits", {}).items():
            if bound is not None and not _HOLDS[relation](value, bound):
                raise ValueError(f"{section}.{spec.name} must be {relation} {bound}, got {value}")
