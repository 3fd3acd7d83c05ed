"""A reproduction resumes from the summaries that landed, never mixing CPU models in a seed."""

import json

import pytest

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.committed_runs import (committed_summaries, runs_still_to_make,
                                                      superseded_seeds)

HERE, THERE = "Xeon (family 6, model 207)", "Xeon (family 6, model 167)"
RUNS = [(variant, seed, []) for seed in (1, 2, 3) for variant in ("healthy", "twin")]


def _commit(folder, variant, seed, cpu):
    (folder / f"{variant}-seed{seed}.json").write_text(json.dumps({"cpu": cpu}))


def _left(folder, runs=RUNS):
    committed = committed_summaries(folder, {seed for _, seed, _ in runs})
    return [(v, s) for v, s, _ in runs_still_to_make(runs, committed, HERE, folder)]


def test_a_whole_seed_from_another_cpu_is_kept_and_a_part_made_here_is_finished(tmp_path):
    _commit(tmp_path, "healthy", 1, THERE)
    _commit(tmp_path, "twin", 1, THERE)
    _commit(tmp_path, "twin", 2, HERE)
    assert _left(tmp_path) == [("healthy", 2), ("healthy", 3), ("twin", 3)]


def test_a_seed_part_made_on_another_cpu_is_refused_by_name(tmp_path):
    _commit(tmp_path, "healthy", 2, THERE)
    with pytest.raises(UserError, match=r"seed 2 .*healthy \(Xeon \(family 6, model 167\)\)"):
        _left(tmp_path)


def test_nothing_committed_leaves_every_run(tmp_path):
    assert _left(tmp_path) == [(v, s) for v, s, _ in RUNS]


def test_a_seed_is_refused_for_a_run_of_it_made_elsewhere_that_was_not_asked_for(tmp_path):
    # a round asks for one variant at a time: the seed's other runs decide its CPU model
    _commit(tmp_path, "healthy", 2, THERE)
    with pytest.raises(UserError, match=r"seed 2 .*healthy \(Xeon \(family 6, model 167\)\)"):
        _left(tmp_path, [("twin", 2, [])])


def test_seed_1_is_not_read_from_seed_11s_summaries(tmp_path):
    _commit(tmp_path, "twin", 11, THERE)
    _commit(tmp_path, "healthy", 1, HERE)
    assert committed_summaries(tmp_path, [1]) == {("healthy", 1): {"cpu": HERE}}
    assert _left(tmp_path, [("twin", 1, [])]) == [("twin", 1)]


def test_a_seed_moved_to_superseded_is_made_again_whole_and_listed(tmp_path):
    """Seed 2, part-made on THERE, moves to superseded/: the runner no longer sees it, so
    every run of seed 2 is left to make here; the listing counts the moved runs per seed."""
    _commit(tmp_path, "healthy", 2, THERE)
    _commit(tmp_path, "twin", 3, HERE)
    with pytest.raises(UserError, match="superseded"):
        _left(tmp_path)
    (tmp_path / "superseded").mkdir()
    (tmp_path / "healthy-seed2.json").rename(tmp_path / "superseded" / "healthy-seed2.json")
    assert _left(tmp_path) == [("healthy", 1), ("twin", 1), ("healthy", 2), ("twin", 2),
                               ("healthy", 3)]
    assert superseded_seeds(tmp_path) == {2: {"runs": 1, "cpus": [THERE]}}
    assert superseded_seeds(tmp_path / "nowhere") == {}
