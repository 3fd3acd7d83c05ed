"""The fault ladder (issue 56): each rung's rounding of O against a hand computation: the
directions on the grid of N mantissa bits, the share of elements a rung takes, the rows a peak
condition selects, and the healthy hold everywhere else."""

import pytest
import torch

from megatron_gnmr.precision.attention_fault import (
    FaultRounding,
    FaultSchedule,
    round_to_nearest,
    round_toward_negative,
)

UNIT = "layers.{}.self_attention.core_attention"


def test_the_two_directions_on_one_bit_by_hand():
    # one mantissa bit: the grid is {0.5, 0.75} x 2^e
    x = torch.tensor([1.3, 1.6, -1.3, 0.7, 0.625, -0.1])
    assert round_toward_negative(x, 1).tolist() == [1.0, 1.5, -1.5, 0.5, 0.5, -0.125]
    # 0.625 lies halfway between 0.5 and 0.75: ties go to the even mantissa (0.5 = 2/4)
    assert round_to_nearest(x, 1).tolist() == pytest.approx([1.5, 1.5, -1.5, 0.75, 0.5, -0.09375])


def test_nearest_is_unbiased_and_down_is_not():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    down, nearest = round_toward_negative(x, 2) - x, round_to_nearest(x, 2) - x
    assert (down <= 0).all() and down.mean() < -0.02
    assert abs(nearest.mean()) < 2e-4 and (nearest > 0).any() and (nearest < 0).any()
    assert nearest.abs().max() <= down.abs().max()  # the same grid, half the largest error


def test_a_share_takes_that_share_of_elements_and_keeps_the_rest_healthy():
    out = torch.randn(4, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    healthy = out * 1.0001  # anything distinguishable from both
    rung = FaultRounding(1, share=0.25, seed=5)
    held = rung.hold(out, None, lambda: healthy)
    taken = held == round_toward_negative(out, 1)
    kept = held == healthy
    assert (taken | kept).all()
    assert taken.float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert torch.equal(held, rung.hold(out, None, lambda: healthy))  # the seed decides
    other = FaultRounding(1, share=0.25, seed=6).hold(out, None, lambda: healthy)
    assert not torch.equal(held, other)


def test_a_peak_condition_rounds_only_the_rows_whose_attention_has_concentrated():
    out = torch.tensor([[[[1.3, 0.7], [1.3, 0.7], [1.3, 0.7]]]])
    probabilities = torch.tensor([[[[1.0, 0.0, 0.0], [0.45, 0.55, 0.0], [0.4, 0.3, 0.3]]]])
    held = FaultRounding(1, peak=0.5).hold(out, probabilities, lambda: out)
    assert torch.equal(held[0, 0], torch.tensor([[1.0, 0.5], [1.0, 0.5], [1.3, 0.7]]))
    with pytest.raises(ValueError, match="needs P"):
        FaultRounding(1, peak=0.5).hold(out, None, lambda: out)


def test_the_default_rung_is_the_fault_of_sections_11_and_13():
    out = torch.randn(2, 3, 8, 4)
    assert torch.equal(FaultRounding(1).hold(out, None, lambda: out * 0),
                       round_toward_negative(out, 1))


def test_the_schedule_gives_a_rung_only_on_its_layers_from_its_start():
    schedule = FaultSchedule(2, 5, frozenset({1}), rounding="nearest", share=0.5, peak=0.3)
    schedule.step = 4
    assert schedule.rounding_for(UNIT.format(1)) is None  # before its start
    schedule.step = 5
    assert schedule.rounding_for(UNIT.format(0)) is None  # not its layer
    rung = schedule.rounding_for(UNIT.format(1))
    assert (rung.bits, rung.rounding, rung.share, rung.peak) == (2, "nearest", 0.5, 0.3)
    schedule.step = 6
    assert schedule.rounding_for(UNIT.format(1)).seed != rung.seed  # a new draw each step
