"""The fault ladder's held-out verdicts and goal (issue 56), against counts made by hand: who is
saved at each margin, what a healthy run costs each arm, the paired and unpaired tests, when a
round is complete, when a rung qualifies, and what the report prints."""

from types import SimpleNamespace

import pytest

from megatron_gnmr.experiments import ladder_goal, ladder_verdicts

MARGINS = {"exact": 0.05, "healthy": 0.2}


def _run(final=3.0, died=None, spent=0.0, cpu="A", first=5):
    return {"final_train_loss": final, "diverged_at": died, "cpu": cpu,
            "recovered_share_of_executed_steps": spent, "first_recovery": first}


def _scenario(seeds=(1, 2, 3, 4)):
    return SimpleNamespace(seeds=list(seeds), base=[], variants={
        "twin-r": [], "chosen@r": ["--gnmr-signals", "kernel_output_bias"],
        "te@r": ["--gnmr-signals", "autoswitch"], "healthy-chosen": [], "healthy-te": []})


def _healthy(seeds=(1, 2, 3, 4)):
    return {("healthy", s): SimpleNamespace(trace=None) for s in seeds}


def _table():
    """Exact attention ends at 3.0 on four seeds; every twin dies. Chosen: +0.01 on seeds 1-3,
    +0.1 on seed 4 (harmed at 0.05, saved at 0.2). TE: diverged on 1 and 2, +0.3 on 3, saved
    on 4."""
    return {"exact-attention": {s: _run(3.0) for s in (1, 2, 3, 4)},
            "twin-r": {s: _run(9.0, died=400) for s in (1, 2, 3, 4)},
            "chosen@r": {1: _run(3.01, spent=0.5), 2: _run(3.01, spent=0.5),
                         3: _run(3.01, spent=0.5), 4: _run(3.1, spent=0.5)},
            "te@r": {1: _run(9.0, died=900), 2: _run(9.0, died=950), 3: _run(3.3),
                     4: _run(3.0)}}


def _judge(monkeypatch, table, fires=None, probe_share=0.01, seeds=(1, 2, 3, 4)):
    """fires: {(arm, seed): step} where the arm's replay on the healthy trace fires."""
    fires = fires or {}
    monkeypatch.setattr(ladder_verdicts, "fires_on", lambda trace, scenario, rule, seed:
                        fires.get((rule.split("@")[0], seed)))
    return ladder_verdicts.verdicts(_scenario(seeds), table, _healthy(seeds), MARGINS,
                                    probe_share)


def test_saved_failed_and_the_paired_tests_by_hand(monkeypatch):
    """Paired at the exact margin: only the chosen arm failed on 1 seed, only TE on 3: the
    one-sided sign test's p (chosen better) is P(at most 1 of 4) = 5/16; at the healthy margin
    TE alone failed, on 3 seeds: 1/8. Fisher at the exact margin, 1 failure of 4 against 3 of
    4: P(X <= 1), X ~ hypergeometric(8, 4, 4) = 17/70."""
    judged = _judge(monkeypatch, _table())
    chosen, te = judged["r"]["chosen"], judged["r"]["te"]
    assert [chosen[s]["failed_at_exact"] for s in (1, 2, 3, 4)] == [False, False, False, True]
    assert [chosen[s]["failed_at_healthy"] for s in (1, 2, 3, 4)] == [False] * 4
    assert [te[s]["failed_at_exact"] for s in (1, 2, 3, 4)] == [True, True, True, False]
    assert chosen[1]["probe"] == pytest.approx(0.005) and te[1]["probe"] == 0.0
    compared = ladder_goal.comparisons(judged["r"], MARGINS)["te"]
    assert compared["failed_at_exact"]["sign_p_chosen_better"] == pytest.approx(5 / 16)
    assert compared["failed_at_exact"]["sign_p_rival_better"] == pytest.approx(15 / 16)
    assert compared["failed_at_exact"]["fisher_p_chosen_better"] == pytest.approx(17 / 70)
    assert compared["failed_at_healthy"]["sign_p_chosen_better"] == pytest.approx(1 / 8)
    assert compared["healthy"]["chosen"] == compared["healthy"]["rival"] == 0


def test_a_healthy_run_costs_the_probe_when_quiet_and_its_live_run_when_it_fires(monkeypatch):
    """The probe costs 1% of the attention's FLOPs on every unit-step left on the low path.
    Quiet on a healthy run, the chosen arm spends 1%, TE nothing. Where the chosen rule fires
    (seed 2, step 30) its live healthy run kept 40% exact: 0.4 + 0.6 * 0.01 = 0.406. Mean over
    four seeds: (3 * 0.01 + 0.406) / 4 = 0.109; TE's 0: the chosen arm spends more on
    healthy runs, so it does not beat TE there, whatever the failures say."""
    table = {**_table(), "healthy-chosen": {2: _run(3.0, spent=0.4, first=30)}}
    judged = _judge(monkeypatch, table, fires={("chosen", 2): 30})
    chosen = judged["r"]["chosen"]
    assert [chosen[s]["healthy_spend"] for s in (1, 2, 3, 4)] == pytest.approx(
        [0.01, 0.406, 0.01, 0.01])
    assert [judged["r"]["te"][s]["healthy_spend"] for s in (1, 2, 3, 4)] == [0.0] * 4
    compared = ladder_goal.comparisons(judged["r"], MARGINS)
    assert compared["te"]["healthy_spend"]["chosen"] == pytest.approx(0.109)
    assert compared["te"]["healthy"]["chosen"] == 1 and compared["te"]["healthy"]["rival"] == 0
    goal = ladder_goal.goal(judged["r"], compared, 0.01, ["te"], MARGINS, whole=True)
    assert goal["beats"]["te"]["healthy spend"] is False and goal["met"] is False


def test_the_goal_counts_a_chosen_run_it_cannot_judge_as_not_saved(monkeypatch):
    """Sixteen seeds, every twin dies, the chosen arm saves every run it can be judged on, TE
    fails all. Two chosen runs were made on CPU model B: 14 saved of 16, the goal's 14 met. A
    third on B, or exact attention of a seed diverging, leaves 13 of 16: not met (the
    denominator stays the 16 twins that died, not the 13 runs that could be judged)."""
    seeds = range(1, 17)

    def table(other_cpu, exact_died=()):
        return {"exact-attention": {s: _run(3.0, died=10 if s in exact_died else None)
                                    for s in seeds},
                "twin-r": {s: _run(9.0, died=400) for s in seeds},
                "chosen@r": {s: _run(3.0, spent=0.5, cpu="B" if s in other_cpu else "A")
                             for s in seeds},
                "te@r": {s: _run(9.0, died=900) for s in seeds}}

    def goal(judged):
        compared = ladder_goal.comparisons(judged["r"], MARGINS)
        return ladder_goal.goal(judged["r"], compared, 0.01, ["te"], MARGINS, whole=True)

    met = goal(_judge(monkeypatch, table({1, 2}), probe_share=0.0, seeds=seeds))
    assert met["saved"] == {"exact": 14, "healthy": 14} and met["died"] == 16 and met["met"]
    assert not goal(_judge(monkeypatch, table({1, 2, 3}), probe_share=0.0, seeds=seeds))["met"]
    judged = _judge(monkeypatch, table({1, 2}, exact_died={5}), probe_share=0.0, seeds=seeds)
    assert not judged["r"]["chosen"][5]["judged"] and judged["r"]["chosen"][5]["gap"] is None
    assert goal(judged)["saved"]["exact"] == 13 and not goal(judged)["met"]


def test_a_rung_whose_twins_die_on_fewer_than_half_the_seeds_is_not_judged(monkeypatch):
    """Twins die on seeds 1 of 4: the rung is reported, its goal neither met nor missed."""
    table = _table()
    for seed in (2, 3, 4):
        table["twin-r"][seed] = _run(3.05)
    judged = _judge(monkeypatch, table)
    goal = ladder_goal.goal(judged["r"], ladder_goal.comparisons(judged["r"], MARGINS), 0.01,
                            ["te"], MARGINS, whole=True)
    assert goal["died"] == 1 and not goal["qualifies"] and goal["met"] is None
    table["twin-r"][2] = _run(9.0, died=300)  # 2 of 4: half qualifies
    judged = _judge(monkeypatch, table)
    assert ladder_goal.goal(judged["r"], ladder_goal.comparisons(judged["r"], MARGINS), 0.01,
                            ["te"], MARGINS, whole=True)["qualifies"]


def test_the_round_is_complete_only_with_every_run_it_judges(monkeypatch):
    """TE's seed-1 run made on CPU model B (its twin and exact attention on A) is never judged
    but not waited for (a rerun would be skipped). The round waits for: a seed in the
    scenario never run; a live healthy run where the replay fires; a chosen run where the twin
    died. A twin run alone (s) missing on a seed leaves only its own table partial."""
    table = {**_table(), "twin-s": {s: _run(3.2) for s in (1, 2, 3, 4)}}
    table["te@r"][1] = _run(3.0, cpu="B")
    scenario = _scenario()
    scenario.variants["twin-s"] = []
    judged = _judge(monkeypatch, table)
    assert not judged["r"]["te"][1]["ran"] and judged["r"]["te"][1]["other_cpu"]
    assert ladder_goal.dying_seeds(judged["r"]["te"]).keys() == {2, 3, 4}
    assert ladder_verdicts.complete(scenario, table, _healthy(), judged)
    scenario.seeds = [1, 2, 3, 4, 5]
    assert not ladder_verdicts.complete(scenario, table, _healthy(), judged)
    scenario.seeds = [1, 2, 3, 4]
    assert ladder_verdicts.secondary_complete(scenario, table)
    del table["twin-s"][3]
    assert ladder_verdicts.complete(scenario, table, _healthy(), judged)
    assert not ladder_verdicts.secondary_complete(scenario, table)
    del table["twin-r"][3]
    assert not ladder_verdicts.complete(scenario, table, _healthy(), judged)
    table["twin-r"][3], table["twin-s"][3] = _run(9.0, died=400), _run(3.2)
    judged = _judge(monkeypatch, table, fires={("te", 2): 40})
    assert not ladder_verdicts.complete(scenario, table, _healthy(), judged)  # healthy-te, 2
    table["healthy-te"] = {2: _run(3.0, spent=0.5, first=40)}
    judged = _judge(monkeypatch, table, fires={("te", 2): 40})
    assert ladder_verdicts.complete(scenario, table, _healthy(), judged)
    del table["chosen@r"][2]
    judged = _judge(monkeypatch, table, fires={("te", 2): 40})
    assert not ladder_verdicts.complete(scenario, table, _healthy(), judged)


def test_every_rule_is_replayed_on_the_twins_no_arm_ran_beside(monkeypatch):
    """Twin s (run alone) and the twins of rung r that lived (seed 2): on seed 1 each rule
    would first recover layer 1 (faulted) at step 50, elsewhere never. Seed 1's exact attention
    ran on another CPU model: the replay stands, its gap is not computed."""
    table = _table()
    table["twin-r"][2] = _run(3.3)
    table["twin-s"] = {1: _run(3.2), 2: _run(9.0, died=100)}
    table["exact-attention"][1] = _run(3.0, cpu="B")
    scenario = _scenario()
    scenario.variants["twin-s"] = []
    units = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]
    traces = {(twin, s): SimpleNamespace(trace=SimpleNamespace(units=units, seed=s),
                                         fault_layers=[1])
              for twin in ("twin-r", "twin-s") for s in (1, 2)}
    monkeypatch.setattr(ladder_verdicts, "first_recovery", lambda trace, scenario, rule, seed: (
        (50, (1,)) if trace.seed == 1 else (None, ())))
    replayed = ladder_verdicts.secondary(scenario, table, traces)
    assert list(replayed) == ["r, lived", "s"] and list(replayed["s"]) == ["chosen", "te"]
    assert list(replayed["r, lived"]["te"]) == [2]
    assert replayed["r, lived"]["te"][2]["gap"] == pytest.approx(0.3)
    assert replayed["s"]["chosen"][1] == {"fires_at": 50, "layers": [1], "names_faulted": True,
                                          "twin_died_at": None, "gap": None}
    assert replayed["s"]["te"][2]["fires_at"] is None and replayed["s"]["te"][2]["gap"] is None


def test_the_probes_cost_is_measured_on_the_rounds_healthy_traces():
    """Two healthy traces measure 1% and 3% (a NaN step ignored): 2%. Twins do not count."""
    import numpy as np

    def loaded(cost):
        return SimpleNamespace(trace=SimpleNamespace(measured={"kernel_probe_cost": np.array(
            cost)}))

    traces = {("healthy", 1): loaded([0.01, np.nan]), ("healthy", 2): loaded([0.03, 0.03]),
              ("twin-r", 1): loaded([0.5])}
    assert ladder_verdicts.measured_probe_share(traces) == pytest.approx(0.02)
    assert ladder_verdicts.measured_probe_share({}) is None


def test_the_report_reads_the_verdicts_as_counted_by_hand(monkeypatch, tmp_path):
    """The four seeds of `_table`: the chosen arm saved 3 (exact margin) and 4 (healthy) of 4
    at 50% + 0.5% spend, 1% on a healthy run; TE saved 1 and 1, diverged twice. The goal needs
    ceil(14 * 4 / 16) = 4 saved at each margin: not met. A live healthy run that first
    recovered at step 31 where its replay said 30 is named."""
    from megatron_gnmr.experiments import ladder_held_out_report as report

    table = {**_table(), "healthy-te": {3: _run(3.0, spent=0.5, first=31)}}
    judged = _judge(monkeypatch, table, fires={("te", 3): 30})
    compared = ladder_goal.comparisons(judged["r"], MARGINS)
    goal = ladder_goal.goal(judged["r"], compared, 0.01, ["te"], MARGINS, whole=True)
    result = {"margins": MARGINS, "rungs": {"r": {
        "arms": judged["r"], "versus_chosen": compared, "goal": goal}}}
    text = "\n".join(report.lines(result))
    chosen_row = next(line for line in text.splitlines() if line.startswith("| chosen |"))
    te_row = next(line for line in text.splitlines() if line.startswith("| te |"))
    assert chosen_row.split(" | ")[1:7] == ["4", "3", "4", "0",
                                            "+0.010, +0.010, +0.010, +0.100", "50.0% + 0.5%"]
    assert chosen_row.split(" | ")[8:10] == ["0/4", "1.00%"]
    assert te_row.split(" | ")[1:5] == ["4", "1", "1", "2"]
    assert f"0.31 ({17 / 70:.2g})" in te_row
    assert te_row.split(" | ")[8:10] == ["1/4", f"{0.5 / 4:.2%}"]
    assert "the twin died on 4 of 4 seeds (median step 400)" in text
    assert "saved 3 at the exact margin, 4 at the healthy margin (needs 4" in text
    assert "**Not met.**" in text
    assert "healthy-te seed 3 (live 31, replay 30)" in text
    judged["r"]["te"][3]["healthy_live_first_recovery"] = None  # it never recovered
    assert "healthy-te seed 3 (live None, replay 30)" in "\n".join(report.lines(result))
    report.write_report(result, tmp_path / "held_out")
    assert (tmp_path / "held_out.png").stat().st_size > 0
    open_round = {**result, "complete": False, "secondary": {"s": {"chosen": {
        1: {"fires_at": 50, "layers": [1], "names_faulted": True, "twin_died_at": None,
            "gap": 0.2},
        2: {"fires_at": None, "layers": [], "names_faulted": None, "twin_died_at": 100,
            "gap": None}}}}}
    open_round["rungs"]["r"]["goal"] = ladder_goal.goal(
        judged["r"], compared, 0.01, ["te"], MARGINS, whole=False)
    judged["r"]["te"][4]["other_cpu"] = True
    text = "\n".join(report.lines(open_round))
    assert "**The round is not complete**" in text and "**Not judged: the round" in text
    assert "never judged: te@r seed 4." in text
    assert "| s | +0.200, x | chosen | 1/2 | 50 | 1/1 |" in text
    assert "this table is partial" not in text
    assert "superseded/" not in text
    open_round["superseded"] = {"106": {"runs": 1, "cpus": ["Xeon 167"]},
                                "12": {"runs": 3, "cpus": ["Xeon 167", "EPYC 17"]}}
    assert ("never judged: seed 12 (3 runs on Xeon 167, EPYC 17); seed 106 (1 runs on "
            "Xeon 167).") in "\n".join(report.lines(open_round))
    open_round["secondary_complete"] = False
    assert "this table is partial" in "\n".join(report.lines(open_round))


def test_the_goal_waits_for_its_own_arms_only(monkeypatch):
    """random, an arm the goal does not read, has run on seed 1 only: the goal can be judged,
    the arms' table is marked partial; TE missing on seed 2 holds the goal open."""
    table = {**_table(), "random@r": {1: _run(3.0, spent=0.5)}}
    scenario = _scenario()
    scenario.variants["random@r"] = ["--gnmr-signals", "random"]
    monkeypatch.setattr(ladder_verdicts, "fires_on", lambda *args: None)
    judged = ladder_verdicts.verdicts(scenario, table, _healthy(), MARGINS, 0.01)
    assert ladder_verdicts.complete(scenario, table, _healthy(), judged)
    assert not ladder_verdicts.arms_complete(judged, ["chosen", "te", "random"])
    del table["te@r"][2]
    judged = ladder_verdicts.verdicts(scenario, table, _healthy(), MARGINS, 0.01)
    assert not ladder_verdicts.complete(scenario, table, _healthy(), judged)
