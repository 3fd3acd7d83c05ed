"""Where a scenario's runs write their logs."""

from pathlib import Path

from megatron_gnmr.experiments.runner import run_log


def test_each_run_has_its_own_log_though_its_name_holds_a_dot():
    """`fp8-lr0.024-seed1` and `-seed2` ran two at a time into one `fp8-lr0.log` when the log's
    name was cut at the LR's dot."""
    out = Path("results") / "lr_edge"
    assert run_log(out / "fp8-lr0.024-seed1") == out / "fp8-lr0.024-seed1.log"
    assert run_log(out / "fp8-lr0.024-seed1") != run_log(out / "fp8-lr0.024-seed2")
