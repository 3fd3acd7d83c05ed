"""The kernel probe (issue 56): its values against an independent float64 computation of the
sampled rows, its cost against the FLOP count by hand, and its isolation from the fault: the
measurement can reach neither the fault's module nor any object of it."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gnmr.precision.attention_fault import FaultRounding
from megatron_gnmr.precision.flash_attention import AttentionPath, FlashAttentionFunction
from megatron_gnmr.precision.kernel_view import KernelView
from megatron_gnmr.precision.measurements import kernel_probe, values
from megatron_gnmr.precision.probes import ProbeBank

UNITS = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]
NAMES = ("kernel_output_bias", "kernel_delta_bias", "kernel_delta_error", "kernel_probe_cost")
PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gnmr"


def _view(seed=0, batch=2, heads=3, seq=10, width=8) -> KernelView:
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, seq, width, generator=g) for _ in range(4))
    out = torch.randn(batch, heads, seq, width, generator=g)  # any stored O: the probe judges
    delta = torch.randn(batch, heads, seq, 1, generator=g)
    return KernelView(q, k, v, out, grad_out, delta, 0.37, sample_seed=11)


def _by_hand(view: KernelView) -> dict:
    """The same rows (the probe's own draw), each recomputed alone with numpy in float64."""
    batch, heads, seq, width = view.q.shape
    draw = torch.Generator().manual_seed(view.sample_seed)
    picks = torch.randint(0, batch * seq, (heads, kernel_probe.ROWS_PER_HEAD), generator=draw)
    r_sum = r_abs = e_sum = e_abs = d_abs = 0.0
    as64 = lambda t: t.numpy().astype(np.float64)  # noqa: E731
    for h in range(heads):
        for pick in picks[h].tolist():
            b, i = divmod(pick, seq)
            scores = as64(view.k[b, h, : i + 1]) @ as64(view.q[b, h, i]) * view.scale
            p = np.exp(scores - scores.max())
            exact = (p / p.sum()) @ as64(view.v[b, h, : i + 1])
            r = as64(view.out[b, h, i]) - exact
            exact_delta = float(as64(view.grad_out[b, h, i]) @ exact)
            e = float(view.delta[b, h, i, 0]) - exact_delta
            r_sum, r_abs = r_sum + r.sum(), r_abs + np.abs(r).sum()
            e_sum, e_abs, d_abs = e_sum + e, e_abs + abs(e), d_abs + abs(exact_delta)
    probe_flops = heads * kernel_probe.ROWS_PER_HEAD * (2 * seq * width * 2 + 2 * width)
    return {"kernel_output_bias": r_sum / r_abs, "kernel_delta_bias": e_sum / e_abs,
            "kernel_delta_error": e_abs / d_abs,
            "kernel_probe_cost": probe_flops / (6 * batch * heads * seq * seq * width)}


def test_the_probe_against_float64_by_hand():
    view = _view()
    bank = ProbeBank(UNITS, None, NAMES)
    bank.probe(UNITS[1]).attention_kernel(view)
    measured = values(NAMES, bank.take().reshape(len(UNITS), -1).numpy())
    for name, expected in _by_hand(view).items():
        assert measured[name][1] == pytest.approx(expected, rel=1e-9), name
        assert np.isnan(measured[name][0])  # the other unit never ran


def test_the_probe_sees_a_one_signed_error_and_not_a_symmetric_one():
    """O stored with a known error: +-1 for a one-signed one, near 0 for one of either sign
    (a stored O that is the exact output plus noise)."""
    view = _view(seed=4, batch=4, heads=2, seq=32)
    b, h, s, d = view.q.shape
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = (view.q.double() @ view.k.double().transpose(-1, -2)) * view.scale
    exact = torch.softmax(scores.masked_fill(causal, -math.inf), -1) @ view.v.double()
    for shift, sign in ((+1e-3, 1.0), (-1e-3, -1.0)):
        one_signed = KernelView(view.q, view.k, view.v, (exact + shift).float(), view.grad_out,
                                view.delta, view.scale, 3)
        bank = ProbeBank(UNITS, None, ("kernel_output_bias",))
        bank.probe(UNITS[0]).attention_kernel(one_signed)
        value = values(("kernel_output_bias",), bank.take().reshape(2, -1).numpy())
        assert value["kernel_output_bias"][0] == pytest.approx(sign, abs=1e-3)
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(8)) * 1e-3
    symmetric = KernelView(view.q, view.k, view.v, (exact + noise).float(), view.grad_out,
                           view.delta, view.scale, 3)
    bank = ProbeBank(UNITS, None, ("kernel_output_bias",))
    bank.probe(UNITS[0]).attention_kernel(symmetric)
    value = values(("kernel_output_bias",), bank.take().reshape(2, -1).numpy())
    assert abs(value["kernel_output_bias"][0]) < 0.1  # 16 x 2 rows x 32: SE about 0.03


def test_the_kernel_shows_the_probe_its_call_on_the_low_path_only():
    """Through the kernel: on the faulted low path O's error is one-signed (the fault's
    rounding toward -inf, seen only through O as stored); on the recovery path the probe is
    shown nothing (NaN)."""
    torch.manual_seed(1)
    q, k, v, grad_out = (torch.randn(2, 2, 16, 8) for _ in range(4))
    low = AttentionPath(fault=FaultRounding(1))
    for path, expect_nan in ((low, False), (AttentionPath(), True)):
        bank = ProbeBank(UNITS, None, NAMES)
        FlashAttentionFunction.apply(q.clone().requires_grad_(), k, v, 0.35, path, None,
                                     bank.probe(UNITS[0]), low, 5).backward(grad_out)
        measured = values(NAMES, bank.take().reshape(2, -1).numpy())
        if expect_nan:
            assert all(np.isnan(measured[name][0]) for name in NAMES)
        else:
            assert measured["kernel_output_bias"][0] < -0.9


def _package_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("megatron_gnmr")}


def _reachable(module: str) -> set[str]:
    """Every project module `module` imports, directly or through others (at any depth,
    function-level imports included)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        relative = Path(*name.split(".")[1:])
        for candidate in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
            if candidate.is_file():
                todo.extend(_package_imports(candidate))
    return seen


@pytest.mark.parametrize("module", ["megatron_gnmr.precision.measurements.kernel_probe",
                                    "megatron_gnmr.precision.kernel_view"])
def test_the_probe_cannot_reach_the_fault(module):
    """Neither the probe nor what the kernel hands it imports the fault, its path or the kernel
    that applies it; a planted `from ..attention_fault import ...` in either fails here."""
    reachable = _reachable(module)
    forbidden = {"megatron_gnmr.precision.attention_fault",
                 "megatron_gnmr.precision.flash_attention",
                 "megatron_gnmr.precision.attention_unit"}
    assert not reachable & forbidden, sorted(reachable & forbidden)


def test_what_the_kernel_hands_the_probe_holds_no_fault():
    """The view the kernel builds on a faulted path: tensors, numbers and an empty memo, no
    object of the experiment (the probe sees only what a kernel exposes)."""
    seen = []

    class Spy:
        watches_output = False

        def attention_operands(self, *args):
            pass

        def attention_delta(self, *args):
            pass

        def attention_kernel(self, view):
            seen.append(view)

    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    low = AttentionPath(fp8=True, fault=FaultRounding(1, share=0.5, seed=9), fp8_output=True)
    FlashAttentionFunction.apply(q, k, v, 0.5, low, None, Spy(), low, 7).sum().backward()
    (view,) = seen
    for name, value in vars(view).items():
        assert isinstance(value, (torch.Tensor, int, float)) or (name == "memo" and value == {}), \
            (name, type(value))
