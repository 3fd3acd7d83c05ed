"""Resource hygiene: images bounded whatever the unit count, figures closed, loggers closed
when one of them fails to start, and the agreement digest covering all controller state."""

import numpy as np
import pytest

from megatron_gnmr.observe.report import MAX_ROWS, RunLog, timeline_figure, unit_rows


def _run_log(num_units: int, steps: int = 40) -> RunLog:
    rng = np.random.default_rng(0)
    units = [f"layers.{u // 500}.mlp.experts.{u % 500}.linear_fc1" for u in range(num_units)]
    return RunLog("big", [], units, rng.random((steps, num_units)) < 0.01,
                  np.exp(rng.normal(size=(steps, num_units))), 2.0)


def test_the_timeline_image_is_bounded_for_31k_units():
    """Agg refuses images above 2^16 pixels a side: the landed code crashed above ~1,300
    units. Rows are grouped above MAX_ROWS, so the image stays the same size."""
    import matplotlib.pyplot as plt

    sizes, open_before = [], plt.get_fignums()
    for num_units in (MAX_ROWS, 31_000):
        figure = timeline_figure(_run_log(num_units))
        figure.canvas.draw()
        sizes.append(figure.canvas.get_width_height())
        plt.close(figure)
    assert sizes[0] == sizes[1] and max(sizes[1]) < 4000
    assert plt.get_fignums() == open_before


def test_grouped_rows_cover_every_unit_in_order():
    labels, row_of = unit_rows([f"u{i}" for i in range(1000)], max_rows=64)
    assert len(labels) == 64 and row_of[0] == 0 and row_of[-1] == 63
    assert np.all(np.diff(row_of) >= 0) and set(row_of) == set(range(64))
    labels, row_of = unit_rows(["a", "b"], max_rows=64)
    assert labels == ["a", "b"] and list(row_of) == [0, 1]


def test_a_logger_that_fails_to_start_closes_those_already_started(monkeypatch, tmp_path):
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.observe import loggers, tensorboard_logger, wandb_logger

    closed = []

    class FakeWandb:
        def __init__(self, *args, **kwargs):
            pass

        def close(self):
            closed.append("wandb")

    class BrokenTensorBoard:
        def __init__(self, *args, **kwargs):
            raise OSError("cannot open event file")

    monkeypatch.setattr(wandb_logger, "WandbLogger", FakeWandb)
    monkeypatch.setattr(tensorboard_logger, "TensorBoardLogger", BrokenTensorBoard)
    config = parse_config(["--wandb-project", "p", "--tensorboard-dir", str(tmp_path / "tb"),
                           "--save", str(tmp_path / "run")])
    with pytest.raises(OSError):
        loggers.build_loggers(config, str(tmp_path / "run"), rank=0)
    assert closed == ["wandb"]


def test_the_agreement_digest_covers_all_controller_state():
    from types import SimpleNamespace

    from megatron_gnmr.controller.config import GNMRRunConfig
    from megatron_gnmr.controller.runtime import Controller

    def controller():
        from megatron_gnmr.controller.policy import GNMRPolicy
        from megatron_gnmr.controller.signals import build_signals
        from megatron_gnmr.precision.plan import PrecisionPlan

        c = Controller.__new__(Controller)
        config = GNMRRunConfig(enabled=True, signals="gnmr,qerr,random")
        names = ["a", "b", "c", "d"]
        c.policy = GNMRPolicy(config.policy_config(), 4)
        c.plan = PrecisionPlan()
        c.signals = build_signals(("gnmr", "qerr", "random"), names, config.signal_settings(0))
        c.alarmed = frozenset()
        c.registry = SimpleNamespace(names=names)
        return c

    reference = controller()._digest()
    for change in (lambda c: c.policy.locks.__setitem__(0, 1),
                   lambda c: c.plan.advance(["b"], 3),
                   lambda c: c.signals[0].qerr_sum.__setitem__(2, 0.5),
                   lambda c: c.signals[1].rng.random(),
                   lambda c: setattr(c, "alarmed", frozenset({"layers.0.mlp."}))):
        changed = controller()
        change(changed)
        assert changed._digest() != reference
    assert controller()._digest() == reference


def test_training_images_are_closed_after_logging():
    """The landed loop called `figure.clf()` but never closed the figure: one leaked per
    --image-interval."""
    from types import SimpleNamespace

    import matplotlib.pyplot as plt

    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.training.loop import Trainer

    logged = []
    trainer = SimpleNamespace(
        config=parse_config(["--image-interval", "1"]), run_dir=None,
        controller=SimpleNamespace(recent_window=lambda: {
            "units": (log := _run_log(16)).units, "gnmr": log.gnmr, "recovery": log.recovery,
            "first_step": 1, "alpha": 2.0}),
        logger=SimpleNamespace(image=lambda step, key, figure: logged.append(key)))
    open_before = plt.get_fignums()
    for step in (1, 2, 3):
        Trainer._log_timeline_image(trainer, step)
    assert logged == ["gnmr/recovery_timeline"] * 3 and plt.get_fignums() == open_before
