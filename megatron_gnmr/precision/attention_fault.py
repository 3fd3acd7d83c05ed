"""The low-precision attention fault to study (SPEC 8.4; Qiu & Yao, arXiv 2510.04212): a
rounding of O where flash attention's backward forms delta = rowsum(dO * O), as a ladder of
strengths and conditions.

Flash attention's backward computes delta = rowsum(dO * O) and dS = P * (dP - delta). When O
is held in low precision and rounded with a bias (rows with repeated maxima and mostly negative
V round the same way), delta is biased, the error accumulates in coherent low-rank directions
of the W_q/W_k updates and training eventually diverges. A natural bias is conditional and
graded: it arises in some rows, on some elements, at some size. The ladder
(`FaultRounding`, `--attention-fault-*`):
- `bits`: O rounded to N mantissa bits (the error's size);
- `rounding`: `down` (toward -inf: a bias) or `nearest` (round-to-nearest-even at the same
  size: no bias, the control rung);
- `share`: the share of O's elements the rounding takes (drawn per layer and step), the others
  held as the healthy low path holds them;
- `peak`: only rows whose largest attention probability reaches it (attention that has
  concentrated, the condition under which the natural bias arises), other rows held healthy.
The defaults (`down`, share 1, peak 0) are the fault of sections 11 and 13: every element
toward -inf.

This module is the experiment's machinery. What the kernel exposes to a probe
(`precision/kernel_view.py`) carries none of it; a test holds the probe away from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUNDINGS = ("down", "nearest")


def round_toward_negative(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)  # |mantissa| in [0.5, 1)
    scale = 2.0 ** (mantissa_bits + 1)
    return torch.ldexp(torch.floor(mantissa * scale) / scale, exponent)


def round_to_nearest(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """To `mantissa_bits` bits, ties to even: the same grid as `round_toward_negative`, the
    error half its size and of either sign."""
    mantissa, exponent = torch.frexp(x)
    scale = 2.0 ** (mantissa_bits + 1)
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent)


ROUNDING_OF = {"down": round_toward_negative, "nearest": round_to_nearest}


@dataclass(frozen=True)
class FaultRounding:
    """One rung of the ladder, as it acts on one core attention in one step (`seed` draws
    the elements a `share` < 1 takes)."""

    bits: int
    rounding: str = "down"
    share: float = 1.0
    peak: float = 0.0
    seed: int = 0

    def hold(self, out: torch.Tensor, probabilities: torch.Tensor | None,
             healthy) -> torch.Tensor:
        """O as the faulted backward holds it: the rounding where the rung takes an element,
        `healthy()` (O as the healthy low path holds it) elsewhere."""
        rounded = ROUNDING_OF[self.rounding](out, self.bits)
        taken = None
        if self.share < 1.0:
            draw = torch.Generator().manual_seed(self.seed)
            taken = (torch.rand(out.shape, generator=draw) < self.share).to(out.device)
        if self.peak > 0.0:
            if probabilities is None:
                raise ValueError("a fault conditioned on the attention's peak needs P")
            rows = probabilities.amax(dim=-1, keepdim=True) >= self.peak
            taken = rows if taken is None else taken & rows
        return rounded if taken is None else torch.where(taken, rounded, healthy())


DRAWN = "drawn:"  # --attention-fault-layers drawn:K


def fault_layers(spec: str, num_layers: int, seed: int) -> frozenset[int]:
    """The layers `--attention-fault-layers` names: `all`, a comma list of 0-based layer
    numbers, or `drawn:K`, K distinct layers drawn from the run's seed (a generator of its
    own, so the draw depends on the seed and the layer count only). ValueError says what is
    wrong with the value."""
    text = spec.strip()
    if text == "all":
        return frozenset(range(num_layers))
    if text.startswith(DRAWN):
        try:
            count = int(text[len(DRAWN):])
        except ValueError:
            raise ValueError(f"{spec!r}: drawn:K takes a whole number of layers") from None
        if not 1 <= count <= num_layers:
            raise ValueError(f"{spec!r}: draws {count} of {num_layers} layers")
        import numpy as np

        rng = np.random.default_rng([seed, 0xFA017])
        return frozenset(int(layer) for layer in rng.choice(num_layers, count, replace=False))
    try:
        layers = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{spec!r}: use all, a comma list of layer numbers or drawn:K") \
            from None
    outside = sorted(layer for layer in layers if not 0 <= layer < num_layers)
    if outside:
        raise ValueError(f"{spec!r}: no layer {', '.join(map(str, outside))} in a model of "
                         f"{num_layers} layers")
    return layers


def layer_of(unit_name: str) -> int:
    """`layers.N.self_attention.core_attention` -> N (the global layer number)."""
    return int(unit_name.split(".")[1])


@dataclass
class FaultSchedule:
    bits: int = 0  # 0: no fault
    start_step: int = 1
    layers: frozenset[int] | None = None  # the faulted layers (None: every layer)
    step: int = 0  # the training step running now (set by the trainer)
    rounding: str = "down"
    share: float = 1.0
    peak: float = 0.0

    @property
    def active(self) -> bool:
        return self.bits > 0 and self.step >= self.start_step

    def hits(self, unit_name: str | None) -> bool:
        """Whether the fault acts on this core attention now."""
        return self.active and (self.layers is None or unit_name is None or
                                layer_of(unit_name) in self.layers)

    def rounding_for(self, unit_name: str | None) -> FaultRounding | None:
        """The rung as it acts on this core attention in this step (None: it does not)."""
        if not self.hits(unit_name):
            return None
        layer = 0 if unit_name is None else layer_of(unit_name)
        return FaultRounding(self.bits, self.rounding, self.share, self.peak,
                             seed=self.step * 65_537 + layer)


def fault_schedule(training, num_layers: int) -> FaultSchedule:
    """The run's fault, from its training section's `attention_fault_*` settings."""
    t = training
    return FaultSchedule(t.attention_fault_bits, t.attention_fault_start,
                         fault_layers(t.attention_fault_layers, num_layers, t.seed),
                         rounding=t.attention_fault_rounding, share=t.attention_fault_share,
                         peak=t.attention_fault_peak)
