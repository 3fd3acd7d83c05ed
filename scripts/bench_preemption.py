"""Does a preemption's save fit torchrun's window? A torchrun job (DP 2, gloo) is sent SIGTERM
at its agent, as a scheduler or an elastic agent's shutdown sends it; the agent passes it to
the workers and SIGKILLs them `--shutdown-timeout` seconds later (30 s by default). Reported
against that window, from the files' own times (not the run's accounting):

- SIGTERM -> published: the tracker file's mtime (the checkpoint of the stop step is the
  newest from then on), SIGTERM -> hashed: the manifest's last write, SIGTERM -> the agent's
  exit; once with nothing in flight (synchronous saves) and once with an async save just
  started when SIGTERM arrives (its writer forked a moment before: the worst case);
- the loop's stall per save: an async save's (snapshot and fork, the polls while it is
  written, the finalize that publishes it) against a synchronous save's, from the
  `checkpoint` events of a 4-step run saving at step 2, and the step time, for scale.

    .venv/bin/python scripts/bench_preemption.py [--size 16x1024] [--repeats 1]
        [--stop-step 3] [--shutdown-timeout 30] [--repo DIR]

`--repo` runs another checkout's pretrain_llama.py (e.g. `git archive` of an older commit),
for a before/after on the same machine. The default size is the issue's; `--size 2x128` is
a smoke (3 minutes on a busy 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # layers x hidden: the model (fp32 weights, Adam)
    "2x128": ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352",
              "--num-attention-heads", "4"],
    "8x512": ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408",
              "--num-attention-heads", "8"],
    "16x1024": ["--num-layers", "16", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
                "--num-attention-heads", "16"],
}
RUN = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr",
       "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--eval-interval", "1000",
       "--eval-iters", "1", "--log-interval", "1",
       "--data-cache-dir", str(REPO / ".cache" / "megatron_gnmr")]
LONG = "1000"  # --train-iters of a run that is stopped by SIGTERM long before its end


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def _torchrun(repo: Path, args: list[str], shutdown_timeout: int | None) -> subprocess.Popen:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    extra = [] if shutdown_timeout is None else [f"--shutdown-timeout={shutdown_timeout}"]
    return subprocess.Popen([torchrun, "--standalone", "--nproc_per_node=2", *extra,
                             str(repo / "pretrain_llama.py"), *args], cwd=repo,
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, job: subprocess.Popen, what: str, limit_s: float = 3600) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if job.poll() is not None:
            raise SystemExit(f"bench_preemption: the job ended before {what}:\n"
                             f"{job.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            job.kill()
            raise SystemExit(f"bench_preemption: no {what} within {limit_s} s")
        time.sleep(0.05)


def preempt(repo: Path, run: Path, model: list[str], in_flight: bool, stop_step: int,
            window_s: int) -> dict:
    """One job stopped by SIGTERM to its agent after `stop_step` (with `in_flight`: the
    moment step `stop_step`'s async save has started)."""
    args = [*model, "--save", str(run), "--train-iters", LONG,
            *(["--async-save", "--save-interval", str(stop_step)] if in_flight else [])]
    job = _torchrun(repo, args, None if window_s == 30 else window_s)
    if in_flight:
        staging = run / f"iter_{stop_step:07d}.tmp"
        _wait_for(staging.exists, job, f"step {stop_step}'s async save")
    else:
        _wait_for(lambda: any(r.get("step", 0) >= stop_step and "train/loss" in r
                              for r in _records(run)), job, f"step {stop_step}")
    sent = time.time()
    job.send_signal(signal.SIGTERM)
    job.wait()
    ended = time.time() - sent
    records = _records(run)
    exits = [r for r in records if r.get("event") == "exit"]
    stopped_at = exits[0]["step"] if exits else None
    tracker = run / "latest_checkpointed_iteration.txt"
    newest = int(tracker.read_text()) if tracker.is_file() else None
    result = {"agent_exit_s": ended, "stopped_at": stopped_at, "newest": newest,
              "published_s": None, "hashed_s": None,
              "step_s": statistics.median(r["train/step_time_s"] for r in records
                                          if "train/step_time_s" in r)}
    if stopped_at is not None and newest == stopped_at:
        directory = run / f"iter_{stopped_at:07d}"
        result["published_s"] = tracker.stat().st_mtime - sent
        manifest = json.loads((directory / "megatron_gnmr.json").read_text())
        if all("sha256" in record for record in manifest["files"].values()):
            result["hashed_s"] = (directory / "megatron_gnmr.json").stat().st_mtime - sent
    return result


def stall(repo: Path, run: Path, model: list[str], asynchronous: bool) -> dict:
    """The loop's stall for step 2's save of a 4-step run (step 4's is the run's last)."""
    job = _torchrun(repo, [*model, "--save", str(run), "--train-iters", "4",
                           "--save-interval", "2",
                           *(["--async-save"] if asynchronous else [])], None)
    if job.wait() != 0:
        raise SystemExit(f"bench_preemption: the run failed:\n{job.stderr.read()[-3000:]}")
    records = _records(run)
    saved = next(r for r in records if r.get("event") == "checkpoint" and r["step"] == 2)
    return {"loop_s": saved["loop_seconds"], "snapshot_s": saved.get("snapshot_seconds"),
            "publish_s": saved.get("publish_seconds"), "until_published_s": saved["seconds"],
            "step_s": statistics.median(r["train/step_time_s"] for r in records
                                        if "train/step_time_s" in r)}


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _median(samples: list[dict], key: str):
    values = [s[key] for s in samples if s[key] is not None]
    return statistics.median(values) if len(values) == len(samples) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="16x1024")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--stop-step", type=int, default=3)
    parser.add_argument("--shutdown-timeout", type=int, default=30,
                        help="torchrun's --shutdown-timeout (the window; 30: torchrun's "
                             "default, not passed)")
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args()
    model = [*SIZES[args.size], *RUN]
    cases = {"nothing in flight": False, "an async save in flight": True}
    preempted = {case: [] for case in cases}
    stalls = {"torch_dist": [], "torch_dist --async-save": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):  # interleaved: every case sees the same machine
            for case, in_flight in cases.items():
                print(f"bench_preemption: repeat {repeat + 1}/{args.repeats}, SIGTERM with "
                      f"{case}", file=sys.stderr)
                preempted[case].append(preempt(
                    args.repo, Path(scratch) / f"r{repeat}" / case.replace(" ", "_"), model,
                    in_flight, args.stop_step, args.shutdown_timeout))
            for form in stalls:
                print(f"bench_preemption: repeat {repeat + 1}/{args.repeats}, the stall of "
                      f"{form}", file=sys.stderr)
                stalls[form].append(stall(args.repo, Path(scratch) / f"r{repeat}" /
                                          form.replace(" ", "_"), model, "async" in form))
    window = args.shutdown_timeout
    print(f"{args.size} LLaMA (fp32 weights, Adam), DP 2 (gloo), {args.repo}; medians of "
          f"{args.repeats}; SIGTERM to torchrun's agent, SIGKILL {window} s later")
    print("| SIGTERM with | step time | -> published | -> hashed | -> agent exit | "
          f"published within {window} s |")
    print("|---|---|---|---|---|---|")
    for case, samples in preempted.items():
        published = _median(samples, "published_s")
        fits = sum(s["published_s"] is not None and s["published_s"] < window
                   for s in samples)
        print(f"| {case} | {_seconds(_median(samples, 'step_s'))} | {_seconds(published)} | "
              f"{_seconds(_median(samples, 'hashed_s'))} | "
              f"{_seconds(_median(samples, 'agent_exit_s'))} | {fits}/{len(samples)} |")
    print()
    print("| save | loop stood still | of which snapshot + fork | of which publication | "
          "until published | step time |")
    print("|---|---|---|---|---|---|")
    for form, samples in stalls.items():
        print(f"| {form} | {_seconds(_median(samples, 'loop_s'))} | "
              f"{_seconds(_median(samples, 'snapshot_s'))} | "
              f"{_seconds(_median(samples, 'publish_s'))} | "
              f"{_seconds(_median(samples, 'until_published_s'))} | "
              f"{_seconds(_median(samples, 'step_s'))} |")


if __name__ == "__main__":
    main()
