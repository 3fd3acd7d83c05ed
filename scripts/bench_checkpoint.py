"""Checkpoint save and load at DP 2 (torchrun, 2 processes), side by side in one launch:
the torch format, torch_dist written synchronously, and torch_dist with --async-save. Per
form: bytes per checkpoint, the seconds the training loop stood still for a save (the
`checkpoint` event's `loop_seconds`: all of the save when synchronous; when async, the
snapshot and the writer's fork, the polls while it is written and the finalize that publishes
it), the seconds until it was published (`seconds`), the load's seconds
(the `resumed` event of a resume after a stop at step 3), and the host memory per rank a save
and a load need by `estimate-memory`'s count (checkpoints/size.py). The save measured
is an interval save (step 2 of 4), not the run's last, which is always synchronous.

    .venv/bin/python scripts/bench_checkpoint.py [--size 8x512|16x1024|24x1536] [--repeats 3]
        [--distributed-optimizer]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # layers x hidden: the model (fp32 weights, Adam)
    "8x512": ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408",
              "--num-attention-heads", "8"],
    "16x1024": ["--num-layers", "16", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
                "--num-attention-heads", "16"],
    "24x1536": ["--num-layers", "24", "--hidden-size", "1536", "--ffn-hidden-size", "4096",
                "--num-attention-heads", "16"],
}
RUN = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr",
       "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--eval-interval", "1000",
       "--eval-iters", "1", "--log-interval", "1"]
FORMS = {"torch": ["--ckpt-format", "torch"], "torch_dist": ["--ckpt-format", "torch_dist"],
         "torch_dist async": ["--ckpt-format", "torch_dist", "--async-save"]}


def _launch(runs: list[list[str]]) -> None:
    """Every run in one torchrun launch, one after another (experiments/in_sequence.py): the
    measured seconds are the runs' own events, so the launch's start is paid once, not per
    run."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(runs, file)
    result = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m",
                             "megatron_gnmr.experiments.in_sequence", file.name], cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True)
    os.unlink(file.name)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])


def _events(run: Path, name: str) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == name]


def runs(form: str, run: Path, model: list[str]) -> list[list[str]]:
    """The save of step 2 (of 4) and a load: the run stops after step 3, as a preempted job
    does, and resumes to step 4 (the same run, which every checkpoint form accepts)."""
    common = [*model, *FORMS[form], "--save", str(run), "--train-iters", "4",
              "--save-interval", "2"]
    return [[*common, "--exit-interval", "3"], [*common, "--resume", "auto"]]


def measured(run: Path) -> dict:
    saved = _events(run, "checkpoint")[0]
    return {"bytes": saved["bytes"], "loop_s": saved.get("loop_seconds", saved["seconds"]),
            "published_s": saved["seconds"], "load_s": _events(run, "resumed")[-1]["seconds"]}


def host_bytes(model: list[str]) -> dict:
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.checkpoints.size import host_bytes_per_rank

    return host_bytes_per_rank(parse_config([*model, "--ckpt-format", "torch_dist"]), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="8x512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()
    model = [*SIZES[args.size], *RUN,
             *(["--use-distributed-optimizer"] if args.distributed_optimizer else [])]
    with tempfile.TemporaryDirectory() as scratch:
        # interleaved: every form sees the same machine
        dirs = [(form, Path(scratch) / f"r{repeat}" / form.replace(" ", "_"))
                for repeat in range(args.repeats) for form in FORMS]
        print(f"bench_checkpoint: {len(dirs) * 2} runs ({args.repeats} repeats of "
              f"{len(FORMS)} forms, a stop and a resume each) in one launch", file=sys.stderr)
        _launch([argv for form, run in dirs for argv in runs(form, run, model)])
        samples = {form: [measured(run) for f, run in dirs if f == form] for form in FORMS}
    median = {form: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
              for form, runs in samples.items()}
    host = host_bytes(model)
    print(f"{args.size} LLaMA (fp32 weights, Adam), DP 2"
          f"{' + distributed optimizer' if args.distributed_optimizer else ''}; medians of "
          f"{args.repeats}; torch_dist host memory per rank (estimate): save "
          f"{host['save'] / 2**20:.0f} MiB, load {host['load'] / 2**20:.0f} MiB")
    print("| form | bytes per checkpoint | loop stood still | until published | load |")
    print("|---|---|---|---|---|")
    for form, m in median.items():
        print(f"| {form} | {m['bytes'] / 2**20:.1f} MiB | {m['loop_s']:.2f} s | "
              f"{m['published_s']:.2f} s | {m['load_s']:.2f} s |")
    sync, other = median["torch_dist"], median["torch_dist async"]
    print(f"| async / sync (torch_dist) | | {other['loop_s'] / sync['loop_s']:.2f} | "
          f"{other['published_s'] / sync['published_s']:.2f} | |")


if __name__ == "__main__":
    main()
