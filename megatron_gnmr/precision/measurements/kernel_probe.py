"""The kernel probe: what can be measured of a core attention from what a production kernel
exposes (`precision/kernel_view.py`: Q, K, V as read, O as stored, dO, the backward's delta),
by recomputing a few rows in float64.

Per call, for each head, `ROWS_PER_HEAD` (batch, query row) pairs are drawn (from the view's
`sample_seed`: the step and the layer). For each sampled row i the probe recomputes, from the
kernel's own Q, K and V, the exact causal attention output O*_i = softmax(scale q_i K^T) V and
the exact delta*_i = dO_i . O*_i, and compares them with what the kernel stored and formed:
  output error r_i = O_i(stored) - O*_i      (a vector: the forward's and the hold's rounding)
  delta error  e_i = delta_i(kernel) - delta*_i
Four values per unit and step, each a ratio of sums (so they add over micro-batches and TP
ranks' heads):
- `kernel_output_bias`   sum r / sum |r|       sign agreement of O's error (+-1: one-signed)
- `kernel_delta_bias`    sum e / sum |e|       sign agreement of delta's error
- `kernel_delta_error`   sum |e| / sum |delta*| delta's relative error
- `kernel_probe_cost`    the probe's FLOPs / the attention's (causal, forward and backward)
The probe never sees why the kernel errs (no fault, no path, no layer list): a healthy FP8
kernel has an error of its own (P and O in E4M3), and a rounding bias must show against it.

A unit on the recovery path runs exact attention: the kernel shows its probe nothing there
(its values are NaN, its cost is not spent). Cost: per sampled row, the scores and the P.V product over the full sequence (the causal
mask is applied, not skipped): 4 x seq x d_head FLOPs; against the attention's 6 x batch x
seq^2 x d_head per head (causal: half of the forward's two GEMMs, and a backward of twice
that), k rows cost 2k / (3 x batch x seq): 1.0% at k = 16, batch 16, seq 64.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots

ROWS_PER_HEAD = 16
SAMPLES_PER_CHUNK = 4096  # (head, row) pairs recomputed at once: bounds the gathered K, V


def _recompute(view) -> dict:
    """The sampled rows' sums, made once per call and shared by the probe's measurements."""
    batch, heads, seq, width = view.q.shape
    draw = torch.Generator().manual_seed(view.sample_seed)
    picks = torch.randint(0, batch * seq, (heads, ROWS_PER_HEAD), generator=draw)
    picks = picks.to(view.q.device).reshape(-1)
    head = torch.arange(heads, device=view.q.device).repeat_interleave(ROWS_PER_HEAD)
    sums = torch.zeros(5, dtype=torch.float64, device=view.q.device)
    positions = torch.arange(seq, device=view.q.device)
    for start in range(0, picks.numel(), SAMPLES_PER_CHUNK):
        pick, h = picks[start:start + SAMPLES_PER_CHUNK], head[start:start + SAMPLES_PER_CHUNK]
        b, row = pick // seq, pick % seq
        query = view.q[b, h, row].double()  # [n, d]
        scores = torch.einsum("nd,nsd->ns", query, view.k[b, h].double()) * view.scale
        scores = scores.masked_fill(positions[None, :] > row[:, None], float("-inf"))
        exact_out = torch.einsum("ns,nsd->nd", torch.softmax(scores, dim=-1),
                                 view.v[b, h].double())
        output_error = view.out[b, h, row].double() - exact_out
        exact_delta = (view.grad_out[b, h, row].double() * exact_out).sum(dim=-1)
        delta_error = view.delta[b, h, row, 0].double() - exact_delta
        sums += torch.stack([output_error.sum(), output_error.abs().sum(), delta_error.sum(),
                             delta_error.abs().sum(), exact_delta.abs().sum()])
    return sums


def recomputed(view) -> torch.Tensor:
    """[sum r, sum |r|, sum e, sum |e|, sum |delta*|] of the call, recomputed once."""
    if "kernel_probe" not in view.memo:
        view.memo["kernel_probe"] = _recompute(view)
    return view.memo["kernel_probe"]


def flops(view) -> tuple[int, int]:
    """(the probe's FLOPs in this call, the attention's: causal, forward and backward)."""
    batch, heads, seq, width = view.q.shape
    value_width = view.v.shape[-1]
    probe = heads * ROWS_PER_HEAD * (2 * seq * width + 2 * seq * value_width + 2 * value_width)
    return probe, 3 * batch * heads * seq * seq * (width + value_width)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / denominator, np.nan)


class KernelOutputBias(Measurement):
    name = "kernel_output_bias"
    slots = 2  # sum r, sum |r|
    watches = "attention"
    parts = (0, 1)

    @torch.no_grad()
    def attention_kernel(self, slots: Slots, view) -> None:
        sums = recomputed(view)
        for slot, part in enumerate(self.parts):
            slots.add(slot, sums[part])

    def value(self, sums: np.ndarray) -> np.ndarray:
        return _ratio(sums[:, 0], sums[:, 1])


class KernelDeltaBias(KernelOutputBias):
    name = "kernel_delta_bias"
    parts = (2, 3)  # sum e, sum |e|


class KernelDeltaError(KernelOutputBias):
    name = "kernel_delta_error"
    parts = (3, 4)  # sum |e|, sum |delta*|


class KernelProbeCost(Measurement):
    name = "kernel_probe_cost"
    slots = 2  # the probe's FLOPs, the attention's
    watches = "attention"

    def attention_kernel(self, slots: Slots, view) -> None:
        probe_flops, attention_flops = flops(view)
        slots.add_count(0, probe_flops)
        slots.add_count(1, attention_flops)

    def value(self, sums: np.ndarray) -> np.ndarray:
        return _ratio(sums[:, 0], sums[:, 1])
