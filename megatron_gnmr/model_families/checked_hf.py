"""A Hugging Face model directory read as untrusted input: every field of config.json that an
import reads is checked against its type and range where it is read (`ConfigJson`), and every
tensor on disk against the shape those fields give it (`check_weights`), so a bad or hostile
directory is one line naming the field or tensor and the file, before anything is written.

The families' mappings read config.json through `ConfigJson` and say which tensors their
classes hold and how big (`Expected`: the shape, and the fields that make it, for the
message); `check_weights` then compares the safetensors files with that, both ways: a tensor
missing, one the config has no place for (3 layers declared, 2 on disk; or the reverse), a
shape that the fields do not make (heads that do not divide the width), a weight that is not
float32, bfloat16 or float16 (an integer, or a quantized float8 one) or that holds NaN or
infinity. The upper bounds are those of our own config (`limits.py`), so what passes here
also builds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.limits import MAX_ROTARY_BASE

REQUIRED = object()  # a field without a default: config.json must give it
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ConfigJson:
    """Typed, range-checked reads of one config.json object (or a table inside it)."""

    def __init__(self, values: object, where: str, name: str = "config.json"):
        if not isinstance(values, dict):
            raise UserError(f"{where}: {name} is {type(values).__name__}, not a JSON object")
        self.values, self.where, self.name = values, where, name

    def fail(self, field: str, why: str):
        shown = repr(self.values[field]) if field in self.values else "(absent)"
        raise UserError(f"{self.where}: {self.name} {field} {shown}: {why}")

    def _get(self, field: str, default):
        value = self.values.get(field)
        if value is None:
            if default is REQUIRED:
                raise UserError(f"{self.where}: {self.name} has no {field}, which the model "
                                "needs")
            return default
        return value

    def integer(self, field: str, default=REQUIRED, ge: int = 1, le: int | None = None):
        """A whole number in [ge, le] (JSON's 2.0 is not one, nor true)."""
        value = self._get(field, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, f"must be a whole number >= {ge}")
        if value < ge or (le is not None and value > le):
            self.fail(field, f"must be from {ge} to {le}" if le is not None else
                      f"must be >= {ge}")
        return value

    def number(self, field: str, default=REQUIRED, gt: float | None = None,
               ge: float | None = None, le: float | None = None):
        """A finite number above `gt` (or at least `ge`), and at most `le`."""
        value = self._get(field, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            self.fail(field, "must be a finite number")
        if (gt is not None and not value > gt) or (ge is not None and not value >= ge):
            self.fail(field, f"must be > {gt}" if gt is not None else f"must be >= {ge}")
        if le is not None and value > le:
            self.fail(field, f"must be at most {le}")
        return float(value)

    def boolean(self, field: str, default: bool = False) -> bool:
        value = self._get(field, default)
        if not isinstance(value, bool):
            self.fail(field, "must be true or false")
        return value

    def word(self, field: str, default=REQUIRED) -> str:
        value = self._get(field, default)
        if not isinstance(value, str):
            self.fail(field, "must be a string")
        return value

    def table(self, field: str) -> "ConfigJson":
        """A nested object (absent or null: an empty one)."""
        value = self.values.get(field)
        return ConfigJson({} if value is None else value, self.where, f"{self.name} {field}")

    def dividing(self, part: str, part_value: int, whole: str, whole_value: int) -> None:
        if whole_value % part_value:
            self.fail(part, f"must divide {whole} {whole_value}")


def rope_table(config: ConfigJson) -> ConfigJson:
    """The RoPE settings: `rope_parameters` (transformers 5), else the older `rope_scaling`."""
    return config.table("rope_parameters" if config.values.get("rope_parameters") is not None
                        else "rope_scaling")


def rope_theta(config: ConfigJson, rope: ConfigJson) -> int:
    """rope_theta (in the rope table, else at the top, else 10000): megatron's RoPE base is a
    whole number, and at most `MAX_ROTARY_BASE`."""
    table = rope if "rope_theta" in rope.values else config
    theta = table.number("rope_theta", 10000.0, gt=0)
    if theta != int(theta):
        table.fail("rope_theta", "megatron's --rotary-base is a whole number")
    if theta > MAX_ROTARY_BASE:
        table.fail("rope_theta", f"must be at most {MAX_ROTARY_BASE:.0e}")
    return int(theta)


def rope_type(rope: ConfigJson) -> str:
    """rope_type (or the older `type`; absent: default)."""
    return rope.word("rope_type") if "rope_type" in rope.values else rope.word("type", "default")


def check_identity(hf: object, where: str) -> None:
    """config.json is an object whose class fields are what transformers reads them as."""
    config = ConfigJson(hf, where)
    architectures = hf.get("architectures")
    if architectures is not None and (not isinstance(architectures, list) or not all(
            isinstance(name, str) for name in architectures)):
        config.fail("architectures", "must be a list of class names")
    if hf.get("model_type") is not None:
        config.word("model_type")


@dataclass(frozen=True)
class Expected:
    """A tensor the config's classes hold: its shape and what in config.json makes it."""

    shape: tuple[int, ...]
    made_by: str
    """The fields that make the shape, with their values ("intermediate_size 176, ...")."""



def outer_weights(model: dict, hidden: int, vocab: int) -> Iterable[tuple[str, Expected]]:
    """The tensors outside the decoder layers every family holds: the embedding, the final
    norm and, untied, the output layer (`model`: our model section)."""
    h, table = f"hidden_size {hidden}", f"vocab_size {vocab}, hidden_size {hidden}"
    yield "model.embed_tokens.weight", Expected((vocab, hidden), table)
    yield "model.norm.weight", Expected((hidden,), h)
    if model["untie_embeddings_and_output_weights"]:
        yield "lm_head.weight", Expected((vocab, hidden), table)

def check_weights(expected: Iterable[tuple[str, Expected]], weights: dict[str, torch.Tensor],
                  files: dict[str, str], where: str, layers: int, left_out: list[str] = ()) \
        -> None:
    """The weights on disk are exactly the expected ones (less those `left_out`), each of its
    shape, of a float dtype and finite; else one UserError naming the tensor, its file and
    the fields of config.json. `expected` is read lazily, no further than one tensor past
    the number on disk: a hostile config (4,096 layers of 16,384 experts) must not make a
    list of 200 million names before the first one is found missing."""
    on_disk = set(weights) - set(left_out)
    wanted = dict(islice(expected, len(on_disk) + 1))
    if len(wanted) <= len(on_disk):  # the whole list: then what is on disk has a place in it
        extra = sorted(on_disk - set(wanted))
        if extra:
            raise UserError(f"{where}: {files.get(extra[0], 'the weights')} holds {extra[0]}, "
                            "which the model config.json describes has no place for"
                            f"{_layer_hint(extra[0], layers, missing=False)}")
    for name, want in wanted.items():  # longer than on disk: one at least is missing
        if name not in on_disk:
            hint = _layer_hint(name, layers, missing=True, on_disk=on_disk) or \
                f" (of shape {want.shape}: config.json's {want.made_by})"
            raise UserError(f"{where}: the weights hold no {name}, which the model config.json "
                            f"describes has{hint}")
        tensor, file = weights[name], files.get(name, "the weights")
        if tuple(tensor.shape) != want.shape:
            raise UserError(f"{where}: {name} in {file} has shape {tuple(tensor.shape)}; "
                            f"config.json's {want.made_by} make it {want.shape}")
        if tensor.dtype not in WEIGHT_DTYPES:
            raise UserError(f"{where}: {name} in {file} is {tensor.dtype}, not a float32, "
                            "bfloat16 or float16 weight (quantized weights are not read: "
                            "dequantize them first)")
        if not bool(torch.isfinite(tensor).all()):
            raise UserError(f"{where}: {name} in {file} holds NaN or infinity")


def _layer_hint(name: str, layers: int, missing: bool, on_disk: set[str] = frozenset()) -> str:
    """" (config.json's num_hidden_layers N)" for a decoder layer's tensor that is extra in a
    layer the config does not have, or missing with its whole layer."""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"]:
        return ""
    if missing:
        hint = not any(held.startswith(f"model.layers.{parts[2]}.") for held in on_disk)
    else:
        hint = not parts[2].isdigit() or int(parts[2]) >= layers
    return f" (config.json's num_hidden_layers {layers})" if hint else ""
