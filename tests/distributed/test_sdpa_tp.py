"""Core attention through torch's SDPA under tensor parallelism (issue 59 item 1): the tiny
GQA model (4 heads, 2 key/value groups: one group per rank at TP 2) trains to the same losses
at TP 1 and TP 2, and to the losses of megatron's own unfused attention (--attention-backend
local) within float tolerance, but not bit for bit: SDPA, not megatron's attention, ran."""

import numpy as np
import pytest

from tests.helpers import TINY, run_batch, run_pretrain, train_losses

STEPS = 5  # TP reorders float sums: the runs drift apart slowly (test_parallel_training)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdpa")
    common = [*TINY, "--train-iters", str(STEPS), "--eval-interval", "100"]
    # in this process, one after the other (megatron-core's config keeps the attention
    # backend it was built with in the environment, which a run in process resets)
    run_pretrain([*common, "--save", str(root / "tp1")])
    run_pretrain([*common, "--attention-backend", "local", "--save", str(root / "unfused")])
    run_batch([[*common, "--tensor-model-parallel-size", "2", "--save", str(root / "tp2")]],
              nproc=2)
    return root


def _losses(run) -> list[float]:
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return [losses[step] for step in range(1, STEPS + 1)]


def test_sdpa_losses_equal_at_tp1_and_tp2(runs):
    np.testing.assert_allclose(_losses(runs / "tp2"), _losses(runs / "tp1"), rtol=1e-5)


def test_sdpa_and_megatron_unfused_attention_train_alike(runs):
    sdpa, unfused = _losses(runs / "tp1"), _losses(runs / "unfused")
    np.testing.assert_allclose(sdpa, unfused, rtol=1e-4)
    assert sdpa != unfused, "the default run should not have run megatron's own attention"
