"""Every emulated recipe (and the real-FP8 torchao recipe) quantizes under TP=2 exactly as
under TP=1 (torchrun, 2 processes).

The emulated recipes' model has per-shard dimensions that are multiples of 128, so the 1x128
tiles and 128x128 blocks of the deepseek recipe cover the same elements in both layouts;
per-tensor scales reduce their amax over the TP group.

The torchao recipe runs real float8 GEMMs (`torch._scaled_mm`), which on some CPUs is a
reference kernel hundreds of times slower than float32: it trains the smallest model whose
every per-shard GEMM dimension is a multiple of 16 under TP=2 (the kernel's rule), for as
many steps (2 to 5) as fit a fixed budget at the float8 GEMM speed measured on this machine
(`tests/float8_budget.py`).

Measured limit: TP sums a row-parallel GEMM's partial products in another order, so a few
values per step land on the other side of an FP8/FP6 rounding midpoint and the runs drift
apart (1.6e-4 relative in the loss by step 5 for fp8-emulated). The FP recipes are
therefore compared at rtol 1e-5 over their first 2 steps and at 1e-3 up to step 5; wrong
scaling under TP (an amax not reduced over the group) shows at step 1 already.
"""

import numpy as np
import pytest

from tests.float8_budget import affordable_steps
from tests.helpers import TINY, run_batch, train_losses

STEPS = 5
ALIGNED = [*TINY, "--hidden-size", "256", "--ffn-hidden-size", "256",
           "--num-attention-heads", "4", "--num-query-groups", "2"]
# Every per-shard dimension a multiple of 16 under TP=2 (qkv N 64, proj K 32, fc1 N 192,
# fc2 K 96, 256 tokens): the smallest model that exercises _scaled_mm's rule under TP.
FLOAT8_SMALL = [*TINY, "--ffn-hidden-size", "192"]
FLOAT8_BUDGET_S = 20.0  # of float8 GEMM time per run (TP=1), whatever the machine's kernel
W8A8_MEASURED = ["--precision-recipe", "w8a8", "--gnmr-measure", "qerr,loss_cost,loss_cost_gross"]
# The planted defects of the measured quantities' TP reduction (tests/distributed/defects.py),
# each a w8a8 run at TP=2 in the same launch: the comparison must fail on them.
DEFECTS = ("probe_partial_dropped", "probe_sums_averaged")
RECIPES = {  # flags, steps compared at rtol 1e-5
    "fp8-emulated": (["--precision-recipe", "fp8-emulated"], 2),
    "fp8-emulated-blockwise": (["--precision-recipe", "fp8-emulated", "--fp8-recipe",
                                "blockwise"], 2),
    "deepseek": (["--precision-recipe", "deepseek"], 2),
    # NVFP4's deterministic parts (stochastic rounding draws per element, so a TP shard
    # draws other numbers than the whole tensor does)
    "nvfp4": (["--precision-recipe", "nvfp4", "--no-nvfp4-stochastic-rounding"], 2),
    "act-quant": (["--precision-recipe", "act-quant", "--act-quant-bits", "3"], STEPS),
    # per-token / per-channel INT8: a row-parallel linear's rows are split along K, so their
    # amaxes are reduced over TP; it measures qerr and the first-order loss cost too (sums
    # over the TP ranks' slices: test_measured_quantities_tp2_match_tp1)
    "w8a8": (W8A8_MEASURED, 2),
    # LoRA on a frozen W8A8 base, adapters in Megatron-Bridge's TP layout (the controller's
    # units are the adapted linears)
    "lora-w8a8": (["--precision-recipe", "w8a8", "--lora", "--lora-dim", "8"], 2),
    # FP8 attention (heads split over TP, per-tensor amaxes reduced over the group) with the
    # fault, each layer's core attention a unit the controller switches
    "attention-fp8": (["--attention-precision", "fp8", "--attention-fault-bits", "1"], 2),
}
FLOAT8_RECIPES = {
    "fp8-torchao": (["--precision-recipe", "fp8-torchao"], 2),
    # torchao's rowwise GEMMs round their float32 output through bf16 (its workaround for
    # _scaled_mm's output dtypes), so a row-parallel GEMM's partial sums are rounded apart:
    # 5e-6 relative at step 1, 3e-5 at step 2.
    "fp8-torchao-rowwise": (["--precision-recipe", "fp8-torchao", "--fp8-recipe", "rowwise"],
                            1),
}
GNMR = ["--gnmr", "--gnmr-delta", "1", "--gnmr-warmup", "2", "--gnmr-alpha", "1.05",
        "--gnmr-beta", "1.05", "--gnmr-max-o", "3"]


def _train_both_layouts(root, runs: dict[str, list[str]], defects: dict = {}) -> None:
    """Each config at TP=1 (one process) and TP=2 (one torchrun launch), and the TP=2 runs
    with planted defects ({defect: config}) in the same launch."""
    tp2 = ["--tensor-model-parallel-size", "2"]
    run_batch([[*args, "--save", str(root / name / "tp1")] for name, args in runs.items()])
    run_batch([[*args, *tp2, "--save", str(root / name / "tp2")] for name, args in runs.items()]
              + [{"argv": [*runs[name], *tp2, "--save", str(root / name / defect)],
                  "defect": defect} for defect, name in defects.items()], nproc=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every emulated recipe at both layouts, STEPS steps (and w8a8 with each defect)."""
    root = tmp_path_factory.mktemp("tp")
    _train_both_layouts(root, {
        name: [*ALIGNED, *flags, *GNMR, "--train-iters", str(STEPS), "--eval-interval", "100"]
        for name, (flags, _) in RECIPES.items()}, {defect: "w8a8" for defect in DEFECTS})
    return root


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory):
    """The real-FP8 recipes at both layouts, for as many steps as this machine affords."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.precision.gemm_shapes import step_macs

    root = tmp_path_factory.mktemp("tp_float8")
    macs = step_macs(parse_config([*FLOAT8_SMALL, "--lr-warmup-iters", "1"]), world_size=1)
    steps = affordable_steps(macs, FLOAT8_BUDGET_S, fewest=2, most=STEPS)
    _train_both_layouts(root, {
        name: [*FLOAT8_SMALL, *flags, *GNMR, "--train-iters", str(steps), "--lr-warmup-iters",
               "1", "--eval-interval", "100", "--eval-iters", "1"]
        for name, (flags, _) in FLOAT8_RECIPES.items()})
    return root, steps


def _compare(root, recipe: str, steps: int, exact_steps: int) -> None:
    tp1, tp2 = train_losses(root / recipe / "tp1"), train_losses(root / recipe / "tp2")
    assert sorted(tp2) == list(range(1, steps + 1))
    np.testing.assert_allclose([tp2[s] for s in range(1, exact_steps + 1)],
                               [tp1[s] for s in range(1, exact_steps + 1)], rtol=1e-5)
    np.testing.assert_allclose([tp2[s] for s in range(1, steps + 1)],
                               [tp1[s] for s in range(1, steps + 1)], rtol=1e-3)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_tp2_matches_tp1(runs, recipe):
    _compare(runs, recipe, STEPS, RECIPES[recipe][1])


@pytest.mark.parametrize("recipe", sorted(FLOAT8_RECIPES))
def test_real_float8_recipe_tp2_matches_tp1(float8_runs, recipe):
    root, steps = float8_runs
    _compare(root, recipe, steps, min(FLOAT8_RECIPES[recipe][1], steps))


# The bounds of a measured quantity across layouts. TP=2 sums its partial products in
# another order than TP=1, so a few of the low path's roundings (an INT8 step of an input
# element) flip where a value sits near a midpoint: the first layer's inputs are the same in
# both layouts, later layers' differ by float32 rounding and flip more, and by the second step
# the weights differ too. Each flip moves one term of a measured sum.
# - qerr (a ratio of sums of squares, no cancellation): relative, 2e-3 (measured on one Xeon
#   over seeds 1-3 and 1234: 6e-4 at worst over steps 1-2).
# - loss_cost = sum of <dL/dy, dy> terms of both signs, which cancel: the sum is ~1% of its
#   terms' magnitudes, so a flip that moves the sum by 1e-3 of the terms moves it by 10% of
#   itself or more, sign included, and a bound relative to the sum fails on any other kernel.
#   It is bounded by its terms' magnitudes instead, loss_cost_gross = sum |dL/dy * dy| (TP=1's:
#   the whole layer's; a row-parallel unit's under TP=2 is its ranks' partial terms', ~sqrt(2)
#   larger): |TP2 - TP1| <= 1e-2 gross (measured: 2.7e-3 at worst, Xeon, same seeds).
# - loss_cost_gross of a column-parallel unit (the ranks hold disjoint slices of the output,
#   so the sum is the whole layer's in both layouts): relative, 1e-2 (measured 1.8e-3); of a
#   row-parallel unit, at least TP=1's less the same 1e-2 (the triangle inequality: the
#   ranks' |partial terms| add up to at least |their sum|; measured ~1.41x TP=1's).
QERR_RTOL, LOSS_COST_OF_GROSS, GROSS_RTOL = 2e-3, 1e-2, 1e-2
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
COMPARED_STEPS = 2


def _measured_violations(tp1, tp2) -> list[str]:
    """Each (quantity, step, unit) of TP=2 outside its bound around TP=1."""
    out = []
    for step in range(COMPARED_STEPS):
        one, two = ({name: values[step] for name, values in trace.measured.items()}
                    for trace in (tp1, tp2))
        for unit, name in enumerate(tp1.units):
            checks = [("qerr", abs(two["qerr"][unit] - one["qerr"][unit]),
                       QERR_RTOL * one["qerr"][unit]),
                      ("loss_cost", abs(two["loss_cost"][unit] - one["loss_cost"][unit]),
                       LOSS_COST_OF_GROSS * one["loss_cost_gross"][unit])]
            gross_one, gross_two = one["loss_cost_gross"][unit], two["loss_cost_gross"][unit]
            checks.append(("loss_cost_gross", abs(gross_two - gross_one) if name.endswith(
                COLUMN_PARALLEL) else gross_one - gross_two, GROSS_RTOL * gross_one))
            out += [f"{quantity} step {step + 1} {name}: off by {off:.3g}, bound {bound:.3g}"
                    for quantity, off, bound in checks if not off <= bound]
    return out


def _w8a8_trace(runs, layout):
    from megatron_gnmr.controller.trace import read_trace

    return read_trace(str(runs / "w8a8" / layout / "gnmr_trace.jsonl"))


def test_measured_quantities_tp2_match_tp1(runs):
    """The probes' sums over TP ranks (a column-parallel rank's slice of the output, a
    row-parallel rank's partial sum) give the whole layer's values: qerr and the signed
    first-order loss cost of every unit, at the first two steps, within the bounds above."""
    tp1, tp2 = _w8a8_trace(runs, "tp1"), _w8a8_trace(runs, "tp2")
    assert tp1.units == tp2.units and len(tp1.units) == 8
    for name in ("qerr", "loss_cost_gross"):
        assert np.all(tp1.measured[name][:COMPARED_STEPS] > 0), name
    assert not _measured_violations(tp1, tp2)


@pytest.mark.parametrize("defect", DEFECTS)
def test_measured_quantities_comparison_fails_on_a_wrong_reduction(runs, defect):
    """The same comparison, on TP=2 runs whose probe sums were reduced wrongly on purpose
    (one rank's partial sums dropped; the sums averaged): it must fail, for several units."""
    violations = _measured_violations(_w8a8_trace(runs, "tp1"), _w8a8_trace(runs, defect))
    assert len(violations) >= 4, violations


def _whole(shards: list, name: str):
    """A weight put back together from its TP shards (fc1: megatron stacks [gate; up] per
    rank, so the halves are gathered separately)."""
    import torch

    if "linear_fc1" in name:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    row = "linear_proj" in name or "linear_fc2" in name
    return torch.cat(shards, dim=1 if row else 0)


def test_lora_merged_under_tp2_equals_merged_under_tp1(runs):
    """merge-lora gathers A (column-parallel bases) or B (row-parallel) across the TP shards:
    the update it adds to each weight (merged - base), reassembled from the TP=2 shards, is
    the TP=1 run's within the runs' own drift, while a shard put in the wrong place is off by
    O(1).

    The bound: the two layouts train apart (a few INT8 rounding decisions flip with the sum
    order of row-parallel GEMMs, which also differs between CPUs). The worst relative
    difference of an update measured over seeds 1-6 was 1.0e-3 to 1.7e-3 on an AMD EPYC, and
    1.12e-2 on one Xeon (the default seed); 5e-2 is 4.5x the worst seen anywhere, and the
    misplaced-shard check below stays over 10x above it."""
    import torch

    from megatron_gnmr.training.merge_lora import merge_run

    updates, swapped = {}, {}
    for layout in ("tp1", "tp2"):
        run = runs / "lora-w8a8" / layout
        merged = merge_run(str(run), str(runs / "lora-w8a8" / f"m{layout}"))
        original = next((run / "checkpoints").glob("iter_*"))
        shards = [(torch.load(original / p.name, weights_only=True)["model"][0],
                   torch.load(p, weights_only=True)["model"][0])
                  for p in sorted(merged.glob("rank_*.pt"))]
        names = [k for k in shards[0][1] if k.endswith(
            ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
             "linear_fc2.weight"))]
        updates[layout] = {n: _whole([m[n] - b[n] for b, m in shards], n) for n in names}
        swapped[layout] = {n: _whole([m[n] - b[n] for b, m in reversed(shards)], n)
                           for n in names}
    assert len(updates["tp1"]) == 8
    bound = 5e-2
    for name, tp1 in updates["tp1"].items():
        difference = (updates["tp2"][name] - tp1).norm() / tp1.norm()
        assert tp1.norm() > 0 and difference < bound, (name, float(difference))
        misplaced = (swapped["tp2"][name] - tp1).norm() / tp1.norm()
        assert misplaced > 10 * bound, (name, float(misplaced))  # the check can fail


def test_a_tp2_lora_runs_peft_adapter_is_its_merged_update(runs, tmp_path):
    """export-hf --adapter gathers a TP=2 run's adapter shards (fc1's B by its [gate; up]
    halves per rank): PEFT's update of every projection, (alpha / r) B A, is the update
    merge-lora adds on the shards (reassembled by `_whole`, put in Hugging Face's names by
    `llama_hf.to_hf`, which transformers judges in tests/test_hf_interop.py). Bound: the merged
    weight is stored in float32, so merged - base carries float32's rounding of W (measured:
    1.3e-7 of the update's norm; 1e-4 allowed); fc1's B gathered as one block is off by 1.0
    (measured), the shards read in the wrong order by O(1)."""
    import torch
    from safetensors.torch import load_file

    from megatron_gnmr.evaluation.loaded_run import run_config
    from megatron_gnmr.interop.hf.peft_adapter import export_adapter
    from megatron_gnmr.model_families.llama_hf import LLAMA_HF
    from megatron_gnmr.training.merge_lora import merge_run

    run = runs / "lora-w8a8" / "tp2"
    config = run_config(run)
    export_adapter(run, tmp_path / "adapter", torch.float32, None)
    weights = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    scale = config.lora.alpha / config.lora.dim
    peft = {name.removeprefix("base_model.model.").replace(".lora_A", ""):
            scale * weights[name.replace("lora_A", "lora_B")].double() @ weights[name].double()
            for name in weights if ".lora_A." in name}
    merged = merge_run(str(run), str(tmp_path / "merged"))
    original = next((run / "checkpoints").glob("iter_*"))
    shards = [(torch.load(original / p.name, weights_only=True)["model"][0],
               torch.load(p, weights_only=True)["model"][0])
              for p in sorted(merged.glob("rank_*.pt"))]
    placeholder = torch.zeros(1)  # to_hf's other entries (norms, embeddings): not compared
    state = {k: placeholder for k in shards[0][0] if ".adapter." not in k}
    for order in (shards, shards[::-1]):
        for name in state:
            if name.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")):
                state[name] = _whole([m[name].double() - b[name].double() for b, m in order],
                                     name)
        theirs = {k: v for k, v in LLAMA_HF.to_hf(state, config).items() if k in peft}
        assert len(theirs) == len(peft) == 2 * 7
        gaps = {k: float((peft[k] - v).norm() / v.norm()) for k, v in theirs.items()}
        if order is shards:
            assert max(gaps.values()) < 1e-4, gaps
        else:
            assert min(gaps.values()) > 0.1, gaps  # the check can fail
