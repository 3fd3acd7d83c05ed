"""Real float8 GEMMs in the test suite, sized by what they cost on the machine at hand.

torch's CPU `_scaled_mm` is fast on some CPUs and a reference kernel on others (hundreds of
times slower than float32: `precision/float8_speed.py`). Tests that train with real FP8
GEMMs (`fp8-torchao`) keep every code path (the % 16 rule, TP splits, rowwise and tensorwise
scales, switching) at small shapes, and choose how many steps to train from the speed
measured once per test run (cached in a file, so every xdist worker and the summary share
one measurement), within a fixed budget of seconds.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from megatron_gnmr.precision.float8_speed import Float8GemmSpeed, measure

RUN_ID = "MEGATRON_GNMR_TEST_RUN"  # set by conftest.pytest_configure, inherited by workers


def _cache() -> Path:
    run = os.environ.get(RUN_ID, str(os.getpid()))
    return Path(tempfile.gettempdir()) / f"megatron-gnmr-float8-{run}.json"


def float8_speed() -> Float8GemmSpeed:
    """This machine's float8 GEMM speed, measured once per test run."""
    path = _cache()
    if path.is_file():
        return Float8GemmSpeed(**json.loads(path.read_text()))
    speed = measure()
    path.write_text(json.dumps({"size": speed.size, "float8_s": speed.float8_s,
                                "float32_s": speed.float32_s}))
    return speed


def affordable_steps(macs_per_step: int, budget_s: float, fewest: int, most: int) -> int:
    """Steps whose float8 GEMMs fit `budget_s` on this machine, within [fewest, most]."""
    seconds_per_step = macs_per_step / float8_speed().float8_macs_per_s
    return max(fewest, min(most, int(budget_s / max(seconds_per_step, 1e-9))))
