"""A run's held-out perplexity two ways: `megatron-gnmr evaluate`'s, and transformers' on the
same samples of the run exported with `export-hf` (float32). The table in
docs/guide/hugging-face.md comes from this script.

    .venv/bin/python scripts/hf_perplexity.py RUN_DIR [--sequences 64] [--keep HF_DIR]

Needs transformers (`pip install -e .[dev]`).
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--keep", default=None, help="write the export here (default: a "
                        "temporary directory)")
    args = parser.parse_args()

    from megatron_gnmr.evaluation.command import mean_loss
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import export
    from megatron_gnmr.training import distributed

    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = Path(args.keep or Path(scratch) / "hf")
        export(args.run_dir, str(hf_dir), "fp32")
        run = load_run(args.run_dir, exact=True)
        try:
            valid = run.valid_split(sequences=args.sequences, seed=0)
            start = time.perf_counter()
            ours = mean_loss(run, valid, args.sequences)
            ours_s = time.perf_counter() - start
            samples = [valid[i] for i in range(min(args.sequences, len(valid)))]
        finally:
            distributed.shutdown()
        start = time.perf_counter()
        theirs = judge.mean_loss(judge.load(hf_dir), samples)
        theirs_s = time.perf_counter() - start
    print(f"held-out sequences: {len(samples)} of {len(samples[0]['tokens'])} tokens")
    print(f"megatron-gnmr evaluate: loss {ours:.6f}  ppl {math.exp(ours):.4f}  ({ours_s:.1f} s)")
    print(f"transformers (export):  loss {theirs:.6f}  ppl {math.exp(theirs):.4f}  "
          f"({theirs_s:.1f} s)")
    print(f"relative difference of the loss: {abs(ours - theirs) / theirs:.2e}")


if __name__ == "__main__":
    main()
