"""The held-out round's run order: arms only where the twin died, asked only once it ran,
read from what landed when an earlier machine made it, on one CPU model a seed."""

import json
from types import SimpleNamespace

from megatron_gnmr.experiments.ladder_held_out_runs import (
    PASSES,
    TWINS_ALONE,
    died_reader,
    fires_reader,
    healthy_runs,
    pass_runs,
    schedule,
    secondary_twins,
    seeds_made_here,
    starts_within,
)

SCENARIO = SimpleNamespace(variants={v: [] for v in (
    "healthy", "exact-attention", "twin-a", "twin-b", "twin-alone",
    "chosen@a", "te-o@a", "te-latch@a", "random@a",
    "chosen@b", "te-o@b", "te-latch@b", "random@b",
    "healthy-chosen", "healthy-te-o", "healthy-te-latch", "healthy-random")})


def test_a_pass_runs_the_twins_first_and_arms_only_on_the_rung_whose_twin_died():
    ran = []

    def died(variant, seed):
        assert {"twin-a", "twin-b"} <= set(ran), "asked before the twins ran"
        return variant == "twin-a" and seed == 7

    def run_pass(seed, arms):
        ran.clear()
        for variant in pass_runs(SCENARIO, seed, arms, died):
            ran.append(variant)  # the runner runs each before asking for the next
        return list(ran)

    base = ["twin-a", "twin-b", "exact-attention", "healthy"]
    assert run_pass(7, PASSES[0]) == [*base, "chosen@a", "te-o@a"]
    assert run_pass(7, PASSES[1]) == [*base, "te-latch@a"]
    assert run_pass(7, PASSES[2]) == [*base, "random@a"]  # the goal's arms first
    assert run_pass(8, PASSES[0]) == base
    assert secondary_twins(SCENARIO) == ["twin-alone"]  # run last, in a pass of their own


def test_a_healthy_arm_runs_only_where_its_rule_fires_on_the_healthy_trace():
    fired = []

    def fires(rule, seed):
        fired.append(rule)
        return rule.startswith("te-o@")

    assert healthy_runs(SCENARIO, 7, PASSES[0], fires) == ["healthy-te-o"]
    assert fired == ["chosen@a", "te-o@a"]  # each arm replayed once, on its first rung's rule


def _commit(folder, run, **summary):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{run}.json").write_text(json.dumps(summary))


def test_a_twin_made_on_an_earlier_machine_is_read_from_its_committed_summary(tmp_path):
    summaries = tmp_path / "docs"
    _commit(summaries, "twin-a-seed7", diverged_at=212)
    _commit(summaries, "twin-b-seed7", diverged_at=None)
    died = died_reader(tmp_path / "results", summaries)  # this machine made none of them
    assert died("twin-a", 7)
    assert not died("twin-b", 7)
    assert not died("twin-a", 8)  # not made anywhere yet


def test_a_rule_is_replayed_on_the_committed_healthy_trace_when_no_run_is_here(
        tmp_path, monkeypatch):
    from megatron_gnmr.experiments import detection_traces, held_out

    summaries = tmp_path / "docs"
    (summaries / "traces").mkdir(parents=True)
    (summaries / "traces" / "healthy-seed7.npz").write_bytes(b"")
    read = []
    monkeypatch.setattr(detection_traces, "read",
                        lambda path: read.append(path) or SimpleNamespace(trace=path.name))
    monkeypatch.setattr(held_out, "fires_on", lambda trace, scenario, rule, seed: 40)
    fires = fires_reader(SCENARIO, tmp_path / "results", summaries)
    assert fires("te-o@a", 7)
    assert read == [summaries / "traces" / "healthy-seed7.npz"]
    assert not fires("te-o@a", 8)  # no healthy trace for seed 8 anywhere: nothing fires


def test_a_seed_with_runs_from_another_cpu_model_is_skipped_by_name(tmp_path, capsys):
    _commit(tmp_path, "twin-a-seed7", cpu="Xeon (model 167)")
    _commit(tmp_path, "twin-a-seed8", cpu="EPYC (model 17)")
    _commit(tmp_path, "twin-a-seed17", cpu="Xeon (model 167)")
    assert seeds_made_here([7, 8, 9, 1], tmp_path, "EPYC (model 17)") == [8, 9, 1]
    assert "seed 7 skipped" in capsys.readouterr().out


def test_each_seed_gets_the_goals_passes_whole_before_the_next_seed_starts():
    from megatron_gnmr.experiments.ladder_goal import goal_arms

    a, b, c = PASSES
    assert set(goal_arms(a + b + c)) == set(a + b)  # the goal's passes hold every arm it reads
    assert list(schedule([5, 6])) == [(a, 5), (b, 5), (a, 6), (b, 6), (c, 5), (c, 6),
                                      (TWINS_ALONE, 5), (TWINS_ALONE, 6)]


def test_no_seed_is_begun_after_the_time_given_but_one_begun_here_goes_on(tmp_path, capsys):
    summaries, out = tmp_path / "docs", tmp_path / "results"
    _commit(summaries, "twin-a-seed6", cpu="here")  # made here in an earlier session
    (out / "twin-a-seed8").mkdir(parents=True)  # begun here in this one
    now = [0.0]
    may_start = starts_within(30, summaries, out, clock=lambda: now[0])
    order = schedule([5, 6, 7, 8, 9], may_start)
    assert next(order) == (PASSES[0], 5)  # within the 30 minutes: seed 5 begins
    now[0] = 31 * 60.0
    a, b, c = PASSES
    assert list(order) == [(b, 5), (a, 6), (b, 6), (a, 8), (b, 8),
                           (c, 5), (c, 6), (c, 8), (TWINS_ALONE, 5), (TWINS_ALONE, 6),
                           (TWINS_ALONE, 8)]
    said = capsys.readouterr().out
    assert "seed 7 not begun" in said and "seed 9 not begun" in said
    assert all(starts_within(None, summaries, out, clock=lambda: 1e9)(seed) for seed in (7, 9))
