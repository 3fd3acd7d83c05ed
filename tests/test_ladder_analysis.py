"""The analyses of issue 56, against hand computations: the LR edge's table (Wortsman's
final loss with diverged runs at their initial loss, the edge, the sensitivity, the paired
gaps), the ladder's lethality at a margin, its choice among detector settings, and the paired
sign test."""

import pytest

from megatron_gnmr.experiments.closed_loop_statistics import sign_test_one_sided
from megatron_gnmr.experiments.detection import Row
from megatron_gnmr.experiments.ladder import choose_for_held_out, killing_rungs, lethality
from megatron_gnmr.experiments.lr_edge import judge


def _run(final, diverged_at=None, initial=8.0):
    return {"final_train_loss": final, "diverged_at": diverged_at, "initial_loss": initial}


def test_the_lr_edge_by_hand():
    table = {
        "bf16-lr0.01": {1: _run(4.0), 2: _run(4.2)},     # mean 4.1 (best)
        "bf16-lr0.02": {1: _run(4.1), 2: _run(4.25)},    # 4.175: within 0.1
        "bf16-lr0.04": {1: _run(4.3), 2: _run(4.3)},     # 4.3: fails (> 4.2)
        "fp8-lr0.01": {1: _run(4.05), 2: _run(4.25)},    # 4.15 (best)
        "fp8-lr0.02": {1: _run(4.1), 2: _run(9.0, diverged_at=700)},  # a seed diverged
        "fp8-lr0.04": {1: _run(4.2), 2: _run(4.2)},      # within, but past a failure
    }
    result = judge(table)
    bf16, fp8 = result["arms"]["bf16"], result["arms"]["fp8"]
    assert bf16["edge"] == 0.02 and fp8["edge"] == 0.01
    assert bf16["divergence_edge"] == 0.04 and fp8["divergence_edge"] == 0.01
    assert fp8["rows"][0.02]["final"][2] == 8.0  # diverged: its initial loss
    assert fp8["rows"][0.02]["mean"] == pytest.approx((4.1 + 8.0) / 2)
    assert bf16["sensitivity"] == pytest.approx((0.0 + 0.075 + 0.2) / 3)
    assert result["paired"][0.02]["gaps"] == pytest.approx([0.0, 8.0 - 4.25])
    assert result["paired"][0.01]["worse"] == 2


def test_lethality_counts_death_and_harm_at_each_margin():
    table = {"twin-r": {1: {"diverged_at": 900, "final_train_loss": None},
                        2: {"diverged_at": None, "final_train_loss": 4.05},
                        3: {"diverged_at": None, "final_train_loss": 4.015},
                        4: {"diverged_at": None, "final_train_loss": 4.0}},
             "exact-attention": {s: {"diverged_at": None, "final_train_loss": 4.0}
                                 for s in (1, 2, 3)}}  # seed 4 has no exact run: not judged
    result = lethality(table, "r", {"exact": 0.02, "healthy": 0.06})
    assert result["judged"] == 3 and result["died"] == 1
    assert result["lethal_at_exact"] == 2  # died; +0.05 > 0.02; +0.015 is not
    assert result["lethal_at_healthy"] == 1  # only the death at 0.06


def test_a_rung_kills_when_its_twins_die_on_half_the_seeds_and_harm_alone_never_kills():
    """Harmed by +0.5 on 3 of 3 seeds, far past either margin: not a killing rung. Died on
    2 of 4 (half): kills; on 1 of 3: does not."""
    exact = {s: {"diverged_at": None, "final_train_loss": 4.0} for s in (1, 2, 3, 4)}
    table = {"exact-attention": exact,
             "twin-harm": {s: {"diverged_at": None, "final_train_loss": 4.5} for s in (1, 2, 3)},
             "twin-half": {s: {"diverged_at": 500 if s < 3 else None, "final_train_loss": 4.0}
                           for s in (1, 2, 3, 4)},
             "twin-once": {s: {"diverged_at": 500 if s == 1 else None, "final_train_loss": 4.0}
                           for s in (1, 2, 3)}}
    margins = {"exact": 0.02, "healthy": 0.06}
    rungs = {rung: lethality(table, rung, margins) for rung in ("harm", "half", "once")}
    assert rungs["harm"]["lethal_at_healthy"] == 3  # lethal by the margin, all the same
    assert killing_rungs(rungs) == ["half"]


def _row(label, family, early, dying, fired, lead=None):
    return Row(label, family, None, dying, early, early, early, lead, None, 8, fired, None, 0,
               0, {})


def test_the_choice_is_quiet_then_most_early_then_best_worst_rung_then_highest_threshold():
    by_setting = {
        "a 1": {"x": _row("a 1", "a", 8, 8, 1), "y": _row("a 1", "a", 8, 8, 1)},  # loud
        "a 2": {"x": _row("a 2", "a", 8, 8, 0, 50), "y": _row("a 2", "a", 2, 8, 0, 50)},
        "a 4": {"x": _row("a 4", "a", 5, 8, 0, 50), "y": _row("a 4", "a", 5, 8, 0, 50)},
        "a 8": {"x": _row("a 8", "a", 5, 8, 0, 50), "y": _row("a 8", "a", 5, 8, 0, 50)},
        "b 1": {"x": _row("b 1", "b", 8, 8, 0, 90), "y": _row("b 1", "b", 8, 8, 0, 90)},
    }
    # a 2, a 4 and a 8 name 10 early: a 4 and a 8 have the better worst rung; a 8 is higher
    assert choose_for_held_out(by_setting, ["x", "y"], ("a",)) == "a 8"
    assert choose_for_held_out(by_setting, ["x", "y"], ("a", "b")) == "b 1"
    assert choose_for_held_out(by_setting, ["x"], ("a",)) == "a 2"  # on x alone it names most
    assert choose_for_held_out(by_setting, [], ("a",)) is None


def test_the_paired_sign_test_by_hand():
    assert sign_test_one_sided(0, 14) == pytest.approx(0.5 ** 14)
    assert sign_test_one_sided(1, 3) == pytest.approx(5 / 16)  # (1 + 4) / 2^4
    assert sign_test_one_sided(0, 0) == 1.0


def _unit_steps(flags: list[str], steps: int = 40) -> list[tuple[int, ...]]:
    """The units a live run with these flags recovers per step, on 4 core attentions."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.controller.policy import GNMRPolicy
    from megatron_gnmr.controller.signals.random_units import RandomSignal

    gnmr = parse_config(["--attention-precision", "fp8", "--gnmr", "--gnmr-units",
                         "core_attention", *flags], announce=False).gnmr
    policy = GNMRPolicy(gnmr.policy_config(), 4)
    signal = RandomSignal([f"u{i}" for i in range(4)], gnmr.signal_settings(run_seed=1))
    return [policy.step([1.0] * 4, other_risk=signal.scores(None), use_gnmr=False).recovery
            for _ in range(steps)]


def test_the_random_arm_keeps_two_units_as_the_chosen_arm_does_not_a_bucket_of_1_5():
    """The held-out random arm: after the warm-up (2 decisions) the same 2 of 4 units every
    step, 50% of the unit-steps as the latched chosen arm spends. The bucket it replaced (rate
    0.4986, capped at max_o 2, rounded down) recovers 2, 1, 2, 1: 37.5%."""
    from megatron_gnmr.experiments.ladder_held_out import arms

    result = {"chosen": "probe-output-sign 1", "best": {}}
    kept = _unit_steps(arms(result)["random"])
    assert kept[:2] == [(), ()] and len(set(kept[2:])) == 1 and len(kept[2]) == 2
    bucket = _unit_steps(["--gnmr-max-o", "2", "--gnmr-t-lock", "0", "--gnmr-delta", "1",
                          "--gnmr-warmup", "2", "--no-gnmr-latch", "--gnmr-signals", "random",
                          "--gnmr-budget-rate", "0.4986"])
    assert sum(map(len, bucket[10:])) / (4 * 30) == 0.375


def test_a_settings_flags_make_a_live_run_decide_as_its_replay():
    """Every ladder family's setting, written as flags for the held-out scenario and parsed
    back as a run parses them, gives the policy and the signal settings its replay uses."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.experiments.detectors import LADDER_FAMILIES, Setting
    from megatron_gnmr.experiments.ladder_held_out import parse_label, setting_flags

    base = ["--attention-precision", "fp8", "--gnmr", "--gnmr-units", "core_attention"]
    for family in LADDER_FAMILIES:
        setting = Setting(family.name, family.grid[-1])
        assert parse_label(setting.label) == setting
        parsed = parse_config([*base, *setting_flags(setting)]).gnmr
        config, signal = setting.controller(4)
        assert parsed.policy_config() == config, family.name
        settings = parsed.signal_settings(run_seed=1)
        assert {key: settings[key] for key in signal} == signal, family.name


def _probe_trace(path, delta_error, loss):
    """A probe arm's detection trace in the committed format (detection_traces.write's)."""
    import json

    import numpy as np

    steps, units = delta_error.shape
    meta = {"name": path.stem, "units": [f"decoder.layers.{u}.self_attention.core_attention"
                                         for u in range(units)],
            "config": {}, "signal_settings": {}, "measured": ["kernel_delta_error"],
            "fault_layers": [], "diverged_at": None, "provenance": {}}
    np.savez_compressed(path, meta=np.array(json.dumps(meta)),
                        norms=np.ones((steps, units), np.float32),
                        alarmed=np.packbits(np.zeros((steps, units), bool), axis=None),
                        loss=np.asarray(loss, np.float32),
                        measured_kernel_delta_error=delta_error.astype(np.float32))


def test_the_lr_edge_replays_the_ladders_choice_on_the_probe_arms(tmp_path):
    """At the LR where layer 2's delta error jumps (step 40, 0.5 against 0.01 elsewhere), the
    ladder's chosen probe-delta-size 0.1 fires at step 40 naming layer 2 and runs it exact from
    step 41 to the end: 60 of 400 unit-steps; at the quiet LR it never fires."""
    import json

    import numpy as np

    from megatron_gnmr.experiments import lr_edge_detectors as seen

    quiet = np.full((100, 4), 0.01)
    loud = quiet.copy()
    loud[39:, 2] = 0.5  # steps 40..100
    _probe_trace(tmp_path / "probe-lr0.006-seed1.npz", quiet, np.linspace(8, 4, 100))
    _probe_trace(tmp_path / "probe-lr0.024-seed1.npz", loud, np.linspace(8, 4.3, 100))
    ladder = tmp_path / "ladder.json"
    ladder.write_text(json.dumps({"best": {"probe-delta-size": "probe-delta-size 0.1",
                                           "te-unit-latch": None}}))
    chosen = seen.chosen_settings(ladder)
    assert list(chosen) == ["probe-delta-size"]
    table = {"bf16-lr0.024": {1: _run(4.1)}, "probe-lr0.024": {1: _run(4.3)},
             "bf16-lr0.006": {1: _run(4.0)}, "probe-lr0.006": {1: _run(4.0)}}
    result = seen.replay(seen.probe_traces(tmp_path), chosen, seen.fates(judge(table)))
    edge, calm = result["probe-delta-size"][0.024][1], result["probe-delta-size"][0.006][1]
    assert (edge["first_alarm"], edge["layers"]) == (40, [2])
    assert edge["spend"] == pytest.approx(60 / 400)
    assert edge["gap_to_bf16"] == pytest.approx(0.2) and not edge["diverged"]
    assert calm["first_alarm"] is None and calm["spend"] == 0.0
    seen.plot(seen.probe_traces(tmp_path), tmp_path / "probe.png")
    assert (tmp_path / "probe.png").stat().st_size > 0
    # lr_edge_controller's uncontrolled arm is named fp8; a name that ends in it is another arm
    _probe_trace(tmp_path / "fp8-lr0.048-seed2.npz", loud, np.linspace(8, 4.3, 100))
    _probe_trace(tmp_path / "not-fp8-lr0.048-seed3.npz", loud, np.linspace(8, 4.3, 100))
    assert seen.probe_traces(tmp_path, "fp8") == {0.048: {2: tmp_path / "fp8-lr0.048-seed2.npz"}}
    assert 0.048 not in seen.probe_traces(tmp_path)
    assert seen.plot_norms(tmp_path, tmp_path / "norms.png")
    assert not seen.plot_norms(tmp_path / "nothing", tmp_path / "none.png")


def test_the_lr_edge_arms_run_where_fp8_fails_and_bf16_lives(tmp_path):
    """From a sweep where FP8 is worse on every seed by 0.05 at 0.01 (within tolerance), by
    0.3 at 0.02, diverges on one seed at 0.04 while BF16 lives there (and is better by only
    0.05 on the other), and BF16 diverges at 0.16: the arms run at 0.02 and 0.04, one step
    below BF16's divergence edge (0.08, where FP8 is also worse by 0.3), not at 0.08. Each arm
    is FP8's flags plus the ladder's arm on the controller round's base; GNMR, which the
    ladder left without a quiet setting, at the project's alpha under the same rule; every
    core attention exact as the positive control; BF16 and FP8 again beside."""
    import json

    import yaml

    from megatron_gnmr.experiments.lr_edge_arms import write_scenario

    table = {"bf16-lr0.01": {1: _run(4.0), 2: _run(4.0)},
             "fp8-lr0.01": {1: _run(4.05), 2: _run(4.05)},
             "bf16-lr0.02": {1: _run(4.05), 2: _run(4.05)},
             "fp8-lr0.02": {1: _run(4.35), 2: _run(4.35)},
             "bf16-lr0.04": {1: _run(4.2), 2: _run(4.2)},
             "fp8-lr0.04": {1: _run(9.0, diverged_at=40), 2: _run(4.25)},
             "bf16-lr0.08": {1: _run(4.5), 2: _run(4.5)},
             "fp8-lr0.08": {1: _run(4.8), 2: _run(4.8)},
             "bf16-lr0.16": {1: _run(4.9), 2: _run(9.0, diverged_at=50)},
             "fp8-lr0.16": {1: _run(9.0, diverged_at=40), 2: _run(9.0, diverged_at=30)}}
    result = json.loads(json.dumps(judge(table)))  # as committed: keys become strings
    lrs = ("0.01", "0.02", "0.04", "0.08", "0.16")
    sweep = {"base": ["--x"], "seeds": [1, 2], "variants": {
        f"{arm}-lr{lr}": [f"--{arm}", lr] for arm in ("bf16", "fp8") for lr in lrs}}
    controller = {"base": ["--x", "--traced"], "variants": {
        "attention-exact-lr0.08": ["--lr", 0.08, "--gnmr-max-o", 4, "--gnmr-signals", "static"]}}
    ladder = {"chosen": "probe-delta-size 0.1", "chosen_spend": 0.2, "best": {}}
    path = tmp_path / "arms.yaml"
    assert write_scenario(ladder, result, sweep, controller, path) == ["0.02", "0.04"]
    scenario = yaml.safe_load(path.read_text())
    variants = scenario["variants"]
    assert scenario["base"] == ["--x", "--traced"] and variants["fp8-lr0.02"] == ["--fp8", "0.02"]
    chosen = variants["chosen-lr0.04"]
    assert chosen[:2] == ["--fp8", "0.04"]
    assert chosen[chosen.index("--gnmr-attention-error-threshold") + 1] == "0.1"
    assert variants["attention-exact-lr0.02"] == ["--fp8", "0.02", "--gnmr-max-o", 4,
                                                  "--gnmr-signals", "static"]
    gnmr = variants["gnmr-lr0.02"]
    assert gnmr[gnmr.index("--gnmr-alpha") + 1] == "2.0" and "--gnmr-latch" in gnmr
    assert gnmr[gnmr.index("--gnmr-max-o") + 1] == "2"
    assert sorted({v.split("-lr")[0] for v in variants}) == sorted(
        ["bf16", "fp8", "attention-exact", "chosen", "gnmr", "first-layer", "random"])


def test_every_arm_is_paired_with_bf16_and_its_spend_and_layers_are_read():
    """At one LR: the first-layer arm 0.1 and 0.3 above BF16 on its two seeds (mean +0.2),
    recovering layer 0 on 50% and 100% of the unit-steps it made (mean 0.75)."""
    def arm_run(final, share, units):
        return {**_run(final), "recovered_share_of_executed_steps": share,
                "recoveries": {f"decoder.layers.{u}.self_attention.core_attention": [[2, 9]]
                               for u in units}}

    table = {"bf16-lr0.02": {1: _run(4.0), 2: _run(4.1)},
             "firstlayer-lr0.02": {1: arm_run(4.1, 0.5, [0]), 2: arm_run(4.4, 1.0, [0])},
             "fp8-lr0.02": {1: _run(4.5), 2: _run(9.0, diverged_at=10)}}
    rows = judge(table)["against_bf16"]
    first = rows["firstlayer"][0.02]
    assert first["gaps"] == pytest.approx([0.1, 0.3]) and first["worse"] == 2
    assert first["spend"] == pytest.approx(0.75) and first["layers"] == [0]
    assert rows["fp8"][0.02]["gaps"] == pytest.approx([0.5, 8.0 - 4.1])
    assert rows["fp8"][0.02]["layers"] == [] and rows["fp8"][0.02]["spend"] == 0.0


def test_runs_made_on_different_cpu_models_are_not_paired():
    table = {"bf16-lr0.02": {1: {**_run(4.0), "cpu": "A"}, 2: {**_run(4.0), "cpu": "A"}},
             "fp8-lr0.02": {1: {**_run(4.5), "cpu": "A"}, 2: {**_run(9.0), "cpu": "B"}}}
    row = judge(table)["paired"][0.02]
    assert row["gaps"] == pytest.approx([0.5]) and row["other_cpu"] == 1
