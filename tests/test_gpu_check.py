"""scripts/gpu_check.sh's program, on the CPU: its smoke run (so that the one prepared GPU
check cannot rot between GPU loans), and its parts that need no GPU: the table and its
verdict, the bitwise comparisons and the recovery flow on fake units, the speed arithmetic,
the timers, and the command line."""

import contextlib
import subprocess
import sys

import pytest
import torch

from megatron_gnmr.gpu_check import check as gpu_check
from megatron_gnmr.gpu_check import speed as gpu_check_speed
from megatron_gnmr.gpu_check.arms import CompiledLayers, Stepper, WorkTimer
from megatron_gnmr.gpu_check.recovery import (CHECKS, SwitchingArm, checked_unit_names,
                                              recovery_rows)
from megatron_gnmr.gpu_check.replay import (bitwise_equal, difference, no_weight_cache,
                                            parameters_set, replay)
from megatron_gnmr.gpu_check.table import (CANNOT_RUN, FAIL, INFO, PASS, info, judged, render,
                                           rows_or_cannot_run)
from tests.helpers import LAUNCH_TIMEOUT_S, REPO


def _table_rows(table: str) -> list[list[str]]:
    """The table's rows as their cells [part, check, result, ok]."""
    return [[cell.strip() for cell in line.strip("| ").split(" | ")]
            for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| part")]


def test_gpu_check_smoke_runs_every_part_and_fails_loudly_on_what_cannot_run(tmp_path):
    out = tmp_path / "gpu_check.md"
    result = subprocess.run([sys.executable, "-m", "megatron_gnmr.gpu_check.check",
                             "--smoke", "--out", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=LAUNCH_TIMEOUT_S, env={"OMP_NUM_THREADS": "1",
                                                         "PATH": "/usr/bin:/bin"})
    # Transformer Engine cannot run on a CPU: its rows fail, so the check fails.
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    table = out.read_text()
    rows = _table_rows(table)
    by_check = {(row[0], row[1]): row for row in rows}
    te_rows = [row for row in rows if row[0] == "(a) te-fp8 recovery"]
    assert len(te_rows) == 4 and all(row[3] == CANNOT_RUN for row in te_rows)
    assert all("Transformer Engine needs CUDA" in row[2] for row in te_rows)
    te_speed = by_check["(b) FP8 pays", "te-fp8 against te: tokens/s"]
    assert te_speed[3] == CANNOT_RUN and "Transformer Engine" in te_speed[2]
    assert "gpu_check: CANNOT RUN (a) te-fp8 recovery" in result.stderr
    # torchao: compiled on both arms, its recovery checked in forward and backward
    torchao = [row for row in rows if row[0] == "(d) torchao recovery"]
    assert [row[1] for row in torchao] == list(CHECKS)
    assert all(row[3] == PASS for row in torchao), torchao
    speed = by_check["(b) FP8 pays", "fp8-torchao (compiled) against fp32 (compiled): tokens/s"]
    assert speed[3] == INFO and "not judged" in speed[2]
    controller = [row for row in rows if row[0] == "(c) controller's cost"]
    assert [row[3] for row in controller] == [CANNOT_RUN, CANNOT_RUN, INFO, INFO]
    assert by_check["training", "fp8-torchao (compiled) trains like fp32 (compiled)"][3] == PASS
    assert "frames compiled" in by_check["(b) FP8 pays", "torch.compile of the layers"][2]
    checks = [row for row in rows if row[0] == "checkpoint"]
    assert len(checks) == 2 and all(row[3] == PASS for row in checks), checks
    assert "bound 0)" in checks[0][2]  # on the CPU a resume is bit for bit
    verdict = table.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: NOT OK: 9 could not run (te-fp8 against te")
    assert "failed" not in verdict


# -- the table ---------------------------------------------------------------------------

def test_a_row_that_cannot_run_fails_the_verdict_and_says_why(capsys):
    def broken():
        raise RuntimeError("cuDNN not found\nsecond line")

    rows = [info("capability", "cuda", "no"), judged("p", "passes", "fine", True),
            *rows_or_cannot_run([("(a) x", "one"), ("(a) x", "two | three")], broken)]
    assert [row.status for row in rows] == [INFO, PASS, CANNOT_RUN, CANNOT_RUN]
    assert rows[2].result == "cannot run: RuntimeError: cuDNN not found"
    ok, table = render("GPU check", ["a note"], rows)
    assert not ok
    assert "| (a) x | two \\| three | cannot run: RuntimeError: cuDNN not found | CANNOT RUN |" \
        in table
    assert table.endswith("verdict: NOT OK: 2 could not run (one; two | three)")
    assert "CANNOT RUN (a) x / one: RuntimeError: cuDNN not found" in capsys.readouterr().err


def test_the_verdict_is_ok_only_when_every_judged_row_passed():
    assert render("t", [], [info("a", "b", "c"), judged("a", "d", "e", True)])[1].endswith(
        "verdict: OK (1 checks passed)")
    ok, table = render("t", [], [judged("a", "d", "e", True), judged("a", "f", "g", False)])
    assert not ok and table.endswith("verdict: NOT OK: 1 failed (f)")


# -- bitwise comparisons -----------------------------------------------------------------

def test_bitwise_equal_compares_bit_patterns():
    zero, negative_zero = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(zero, negative_zero) and not bitwise_equal(zero, negative_zero)
    nan = torch.tensor([float("nan"), 1.0])
    assert not torch.equal(nan, nan) and bitwise_equal(nan, nan.clone())
    assert not bitwise_equal(zero, zero.double()) and bitwise_equal(None, None)
    assert not bitwise_equal(zero, None)
    assert difference(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0])) == \
        "1 of 3 elements differ, max |diff| 5.00e-01"


def test_replay_returns_the_three_gemms_and_leaves_training_state_alone():
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(3, 2, bias=False).double()
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    dy = torch.randn(4, 2, generator=generator, dtype=torch.float64)
    fired = []  # megatron's DDP hooks the gradient accumulator like this
    accumulator = linear.weight.expand_as(linear.weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *args: fired.append(True))
    got = replay(linear, x, dy)
    w = linear.weight.detach()
    assert torch.allclose(got.output, torch.einsum("tk,nk->tn", x, w))
    assert torch.allclose(got.dgrad, torch.einsum("tn,nk->tk", dy, w))
    assert torch.allclose(got.wgrads["weight"], torch.einsum("tn,tk->nk", dy, x))
    assert linear.weight.grad is None and not fired
    linear(x).sum().backward()  # the hook is live: an ordinary backward runs it
    assert fired


def test_replay_refuses_a_weight_gradient_fused_into_main_grad():
    linear = torch.nn.Linear(3, 2)
    linear.fuse_wgrad_accumulation = True
    with pytest.raises(RuntimeError, match="--gradient-accumulation-fusion"):
        replay(linear, torch.randn(2, 3), torch.randn(2, 2))


def test_parameters_set_installs_values_and_restores_them():
    linear = torch.nn.Linear(2, 2, bias=False)
    before = linear.weight.detach().clone()
    with parameters_set(linear, {"weight": torch.ones(2, 2)}):
        assert torch.equal(linear.weight, torch.ones(2, 2))
    assert torch.equal(linear.weight, before)
    with pytest.raises(ValueError, match=r"parameters \['weight'\], the captured ones are "
                                         r"\['bias', 'weight'\]"):
        with parameters_set(linear, {"weight": before, "bias": before[0]}):
            pass


def test_no_weight_cache_makes_a_te_linear_cast_anew_and_restores_it():
    module = torch.nn.Module()
    module.disable_parameter_transpose_cache, module.is_first_microbatch = False, True
    with no_weight_cache(module):
        assert module.disable_parameter_transpose_cache is True
        module.is_first_microbatch = False  # megatron's forward does this
    assert (module.disable_parameter_transpose_cache, module.is_first_microbatch) == (False, True)
    plain = torch.nn.Linear(2, 2)
    with no_weight_cache(plain):
        assert not hasattr(plain, "disable_parameter_transpose_cache")


# -- the recovery flow on fake units -------------------------------------------------------

def _coarse(t):
    """The fake low-cost path's rounding (an FP8 stand-in)."""
    return torch.round(t * 4) / 4


class _FakeGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_low, backward_exact):
        ctx.save_for_backward(x, weight)
        ctx.backward_exact = backward_exact
        return x @ weight.t() if weight_low is None else _coarse(x) @ weight_low.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        used = weight if ctx.backward_exact else _coarse(weight)
        return dy @ used, dy.t() @ x, None, None


class FakeUnit(torch.nn.Module):
    """A unit linear with a recovery switch and a weight cache like TE's (cast on a step's
    first micro-batch, reused after; megatron's `disable_parameter_transpose_cache` casts
    anew). Its faults: a backward that ignores the switch, a cache never refreshed, a low
    path that is exact."""

    def __init__(self, name, plan, weight, backward_follows=True, refreshes=True, low=_coarse):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.name, self.plan, self.low = name, plan, low
        self.backward_follows, self.refreshes = backward_follows, refreshes
        self.is_first_microbatch, self.disable_parameter_transpose_cache = True, False
        self.cache = None

    def forward(self, x):
        recovered = self.name in self.plan.recovery
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        weight_low = None
        if not recovered:
            if first is None or self.cache is None or (first and self.refreshes):
                weight_low = self.low(self.weight.detach())
                if first is not None:
                    self.cache = weight_low
            else:
                weight_low = self.cache
        self.is_first_microbatch = False
        if self.low is not _coarse and not recovered:  # a "low" path that rounds nothing
            return x @ self.weight.t(), None
        backward_exact = recovered and self.backward_follows
        return _FakeGemm.apply(x, self.weight, weight_low, backward_exact), None


class ExactUnit(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x):
        return x @ self.weight.t(), None


def _flow(**fault) -> list:
    """recovery_rows over two fake units trained by SGD, one of them faulty."""
    plan = type("Plan", (), {"recovery": frozenset()})()
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(3, 4, generator=generator, dtype=torch.float64)
               for name in ("layers.0.mlp.linear_fc1", "layers.0.mlp.linear_fc2")}
    units = {name: FakeUnit(name, plan, w, **(fault if "fc2" in name else {}))
             for name, w in weights.items()}
    reference = {name: ExactUnit(w) for name, w in weights.items()}

    def train_step(step):
        data = torch.Generator().manual_seed(step)
        loss = 0
        for unit in units.values():
            unit.is_first_microbatch = True  # megatron's set_is_first_microbatch
            x = torch.randn(5, 4, generator=data, dtype=torch.float64, requires_grad=True)
            y = unit(x)[0]
            loss = loss + (y * torch.randn(y.shape, generator=data, dtype=torch.float64)).sum()
        loss.backward()
        with torch.no_grad():
            for unit in units.values():
                unit.weight -= 0.1 * unit.weight.grad
                unit.weight.grad = None

    arm = SwitchingArm(units, plan, train_step, lambda unit: contextlib.nullcontext())
    for step in range(3):
        train_step(step)
    rows = recovery_rows("(a)", arm, reference, list(units), step=3)
    assert plan.recovery == frozenset()  # the flow leaves the plan as it found it
    return rows


def test_the_recovery_flow_passes_a_unit_that_switches_correctly():
    rows = _flow()
    assert [row.check for row in rows] == list(CHECKS)
    assert [row.status for row in rows] == [PASS] * 4, rows


def test_the_recovery_flow_catches_a_backward_that_ignores_the_switch():
    """The forward-only check of old passes this unit; the backward replay does not."""
    rows = _flow(backward_follows=False)
    assert [row.status for row in rows] == [PASS, FAIL, PASS, PASS]
    assert "layers.0.mlp.linear_fc2: dgrad:" in rows[1].result
    assert "linear_fc1" not in rows[1].result and "wgrad" not in rows[1].result


def test_the_recovery_flow_catches_a_stale_fp8_weight_cache():
    rows = _flow(refreshes=False)
    assert [row.status for row in rows] == [PASS, PASS, FAIL, PASS]
    assert rows[2].result.startswith("1 of 2 units differ: layers.0.mlp.linear_fc2: output:")


def test_the_recovery_flow_catches_a_low_path_that_is_not_low():
    rows = _flow(low=lambda w: w)
    assert [row.status for row in rows] == [PASS, PASS, PASS, FAIL]
    assert "layers.0.mlp.linear_fc2: output equals BF16's" in rows[3].result


def test_checked_units_are_the_first_layer_and_the_last_fc2():
    names = [f"layers.{i}.{s}" for i in range(3) for s in ("self_attention.linear_qkv",
                                                          "mlp.linear_fc2")]
    assert checked_unit_names(names, 3) == ["layers.0.self_attention.linear_qkv",
                                            "layers.0.mlp.linear_fc2", "layers.2.mlp.linear_fc2"]


# -- speed arithmetic and timers -------------------------------------------------------------

def test_fp8_pays_against_its_own_bf16_arm_at_the_goal():
    # 4096 tokens in a median 0.08 s = 51,200 tokens/s against 4096 / 0.1 = 40,960: x1.25
    row = gpu_check_speed.fp8_pays_row("(b)", "te-fp8", "te", 4096, [0.08, 0.07, 0.5], [0.1])
    assert row.status == PASS and row.result == "51,200 against 40,960: x1.25 (goal x1.20)"
    assert row.check == "te-fp8 against te: tokens/s"
    slow = gpu_check_speed.fp8_pays_row("(b)", "te-fp8", "te", 4096, [0.09], [0.1])
    assert slow.status == FAIL and "x1.11" in slow.result
    assert gpu_check_speed.fp8_pays_row("(b)", "a", "b", 1, [1.0], [1.0], judge=False).status \
        == INFO


def test_the_controller_cost_rows():
    on, plain = gpu_check_speed.controller_rows(
        "(c)", "on", "off", on_seconds=[0.1015], off_seconds=[0.1], on_work=[0.0030],
        off_work=[0.0010])
    assert on.status == FAIL and "101.5 ms against 100.0 ms: +1.50%" in on.result
    # (3.0 - 1.0) ms over a 101.5 ms step: +1.97%
    assert plain.status == FAIL and "3.00 ms" in plain.result and "+1.97% of the step" in \
        plain.result
    cheap = gpu_check_speed.controller_rows("(c)", "on", "off", [0.1005], [0.1], [0.0011],
                                            [0.0010])
    assert [row.status for row in cheap] == [PASS, PASS]


def test_work_timer_times_both_calls_of_a_step_and_comes_off():
    class Component:
        def after_backward(self, step, optimizer, loss):
            return "outcome"

        def decide(self, step, alarmed):
            return {}

    component = Component()
    timer = WorkTimer(component)
    assert component.after_backward(1, None, 0.0) == "outcome" and component.decide(1, ()) == {}
    component.after_backward(2, None, 0.0)
    component.decide(2, ())
    assert len(timer.seconds) == 2 and all(s >= 0 for s in timer.seconds)
    timer.remove()
    assert "after_backward" not in vars(component) and "decide" not in vars(component)


def test_stepper_rotates_arms_and_leaves_warmup_untimed():
    """Arms step in rotating order, warm-up untimed, each under its own quantizer compile
    mode (a process-wide setting)."""
    from types import SimpleNamespace

    from megatron_gnmr.precision import scaling

    calls, modes = [], []

    class Trainer:
        def __init__(self, name, mode):
            self.name = name
            self.config = SimpleNamespace(training=SimpleNamespace(quantizer_compile=mode))

        def train_step(self, step):
            calls.append((self.name, step))
            modes.append((self.name, scaling._compile_mode))
            return {"train/loss": float(step)}

    stepper = Stepper({"a": Trainer("a", "off"), "b": Trainer("b", "on")})
    try:
        seconds, losses = stepper.side_by_side(["a", "b"], steps=2, warmup=1)
    finally:
        scaling.set_quantizer_compile("auto")
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert len(seconds["a"]) == 2 and losses["b"] == [0.0, 1.0, 2.0]
    assert stepper.next_step == {"a": 3, "b": 3}
    assert set(modes) == {("a", "off"), ("b", "on")}


def test_compiled_layers_can_run_eager_for_a_while():
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    compiled = CompiledLayers(layers, "eager")  # lazy: nothing is traced before a call
    forwards = [vars(layer)["forward"] for layer in layers]
    with compiled.eager():
        assert all("forward" not in vars(layer) for layer in layers)
    assert [vars(layer)["forward"] for layer in layers] == forwards


def test_the_compile_row_counts_what_happened_during_the_group():
    from megatron_gnmr.gpu_check.groups import _compile_summary

    cast = "Unexpected type\n  Explanation: SourcelessBuilder.create does not know CastConfig\n"
    before = (10, {cast: 2, "warn": 4})
    after = (15, {cast: 5, "warn": 4, "other": 1})
    assert _compile_summary(before, after, steps=8, arms=3) == (
        "5 frames compiled and 4 graph breaks over 8 steps of 3 arms (most often, 3x: "
        "Explanation: SourcelessBuilder.create does not know CastConfig)")
    assert _compile_summary(after, after, 8, 3) == \
        "0 frames compiled and 0 graph breaks over 8 steps of 3 arms"


# -- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--steps", "1"], "error: --steps 1: the check takes a median"),
    (["--smoke", "--compile-backend", "nope"], "error: --compile-backend nope: torch.compile "
                                               "knows aot_eager"),
    ([], "error: gpu_check needs a GPU (torch is a CPU-only build"),
])
def test_the_command_line_refuses_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err
