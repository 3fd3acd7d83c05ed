"""Detectors inside real runs: the alarms a live run raises are exactly those its logged
signals give when replayed offline (so `compare-alarms` measures what live runs do), and
`--monitor-reference` reads a healthy run, uses it, and warns on a config mismatch."""

import json

from megatron_gnmr.experiments.alarm_replay import replay_alarms
from megatron_gnmr.monitors.alarms import AlarmBook
from megatron_gnmr.monitors.detectors.reference_runs import load_reference_signals
from tests.helpers import TINY, read_jsonl, run_pretrain

# Checks every step, and detectors tuned to fire on ordinary noise, so there is something
# to compare.
TWITCHY = [*TINY, "--train-iters", "40", "--eval-interval", "100", "--monitors", "attention",
           "--monitor-interval", "1", "--monitor-delta", "1", "--monitor-patience", "2",
           "--monitor-band", "0.5"]


def _live_alarms(run_dir):
    return [(r["step"], f"{r['monitor']}/layer{r['layer']}/{r['signal']}", r["detector"])
            for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "alarm"]


def test_live_trend_alarms_equal_their_offline_replay(tmp_path):
    run = tmp_path / "trend"
    run_pretrain([*TWITCHY, "--monitor-trend-window", "4", "--monitor-trend-horizon", "2",
                  "--save", str(run)])
    live = _live_alarms(run)
    book = AlarmBook(detector="trend", band=0.5, patience=2, trend_window=4, trend_horizon=2)
    replayed = [(e["step"], e["key"], e["detector"])
                for e in replay_alarms(read_jsonl(run / "metrics.jsonl"), book)
                if not e["key"].startswith("loss/")]
    assert live and live == replayed
    assert json.loads((run / "config.json").read_text())["monitor"]["monitor_trend_window"] == 4


def test_reference_runs_drive_the_live_band_and_mismatches_are_warned(tmp_path):
    healthy, live = tmp_path / "healthy", tmp_path / "live"
    run_pretrain([*TWITCHY, "--seed", "1", "--save", str(healthy)])
    run_pretrain([*TWITCHY, "--seed", "2", "--lr", "2e-3", "--monitor-reference",
                  str(healthy), "--monitor-reference-smooth", "1", "--save", str(live)])
    records = read_jsonl(live / "metrics.jsonl")
    warnings = [r["reference_mismatch"] for r in records if r.get("event") == "warning"]
    assert warnings == [f"{healthy}: training.lr = 0.003, this run has 0.002"]
    alarms = _live_alarms(live)
    assert alarms and {d for _, _, d in alarms} == {"reference"}
    book = AlarmBook(detector="reference", band=0.5, patience=2, reference_smooth=1,
                     references=load_reference_signals([str(healthy)]))
    replayed = [(e["step"], e["key"], e["detector"]) for e in replay_alarms(records, book)
                if not e["key"].startswith("loss/")]
    assert alarms == replayed
