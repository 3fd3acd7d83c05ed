"""Save and load of the 8 x 512 model at DP 2 (torchrun, 2 processes) in both checkpoint
formats, side by side in one invocation: bytes written per checkpoint, save and load seconds
(the `checkpoint` and `resumed` events' timings, which span the whole collective: staging,
writing, hashing, publishing), and torch_dist's ratio to torch.

    .venv/bin/python scripts/bench_checkpoint.py [--repeats 3] [--distributed-optimizer]
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
MODEL = ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408",
         "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0",
         "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1"]


def _launch(args: list[str]) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2",
                             str(REPO / "pretrain_llama.py"), *args], cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])


def _events(run: Path, name: str) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == name]


def measure(form: str, root: Path, extra: list[str]) -> dict:
    """One save (step 2) and one load (the resume to step 3)."""
    run = root / form
    common = [*MODEL, *extra, "--ckpt-format", form, "--save", str(run)]
    _launch([*common, "--train-iters", "3", "--exit-interval", "2", "--save-interval", "2"])
    _launch([*common, "--train-iters", "3", "--resume", "auto", "--save-interval", "100"])
    saved = _events(run, "checkpoint")[0]
    return {"bytes": saved["bytes"], "save_s": saved["seconds"],
            "load_s": _events(run, "resumed")[-1]["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()
    extra = ["--use-distributed-optimizer"] if args.distributed_optimizer else []
    samples = {"torch": [], "torch_dist": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):  # interleaved: both formats see the same machine
            for form in samples:
                samples[form].append(measure(form, Path(scratch) / f"r{repeat}", extra))
    median = {form: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
              for form, runs in samples.items()}
    print(f"8 x 512 LLaMA (fp32 weights, Adam), DP 2"
          f"{' + distributed optimizer' if extra else ''}; medians of {args.repeats}")
    print("| format | bytes per checkpoint | save | load |")
    print("|---|---|---|---|")
    for form, m in median.items():
        print(f"| {form} | {m['bytes'] / 2**20:.1f} MiB | {m['save_s']:.2f} s | "
              f"{m['load_s']:.2f} s |")
    t, d = median["torch"], median["torch_dist"]
    print(f"| torch_dist / torch | {d['bytes'] / t['bytes']:.2f} | "
          f"{d['save_s'] / t['save_s']:.2f} | {d['load_s'] / t['load_s']:.2f} |")


if __name__ == "__main__":
    main()
