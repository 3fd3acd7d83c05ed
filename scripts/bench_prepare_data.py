"""Peak memory of `prepare-data --input ... --output-prefix ...` (data/preprocess.py) against
the corpus size: the same text repeated into JSONL files of growing size, each tokenized in a
fresh process tree whose resident memory (the parent and its worker processes, summed) is
sampled every 20 ms. Flat in the corpus size means streaming: documents go through the
workers in windows and straight into megatron-core's IndexedDatasetBuilder, nothing is held.

    .venv/bin/python scripts/bench_prepare_data.py [--sizes-mib 8 32 128] [--workers 2]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / ".cache" / "megatron_gnmr" / "corpora" / "shakespeare"
TOKENIZER = REPO / ".cache" / "megatron_gnmr" / "shakespeare-v4096" / "tokenizer.model"


def write_corpus(path: Path, mib: int) -> int:
    """JSONL documents of 40 lines of Shakespeare, repeated until `mib` MiB."""
    lines = [line for text in sorted(CORPUS.glob("*.txt"))
             for line in text.read_text(errors="replace").splitlines() if line.strip()]
    documents = [json.dumps({"text": "\n".join(lines[i:i + 40])}) + "\n"
                 for i in range(0, len(lines) - 40, 40)]
    written, count = 0, 0
    with path.open("w") as out:
        while written < mib * 2**20:
            for document in documents:
                out.write(document)
                written += len(document)
                count += 1
                if written >= mib * 2**20:
                    break
    return count


def peak_rss_mib(command: list[str]) -> tuple[float, float]:
    """(peak resident MiB of the process tree, wall seconds)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    if process.returncode != 0:
        raise SystemExit(process.stderr.read().decode()[-2000:])
    return peak / 2**20, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if not TOKENIZER.is_file():
        raise SystemExit("run `megatron-gnmr prepare-data` first (the tokenizer)")
    print(f"prepare-data --output-prefix, {args.workers} workers, SentencePiece "
          f"({TOKENIZER.parent.name}), {psutil.cpu_count()} CPUs")
    print("| corpus | documents | peak RSS (process tree) | wall | MiB/s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for mib in args.sizes_mib:
            corpus = Path(scratch) / f"corpus_{mib}.jsonl"
            documents = write_corpus(corpus, mib)
            peak, wall = peak_rss_mib([
                sys.executable, "-m", "megatron_gnmr.cli", "prepare-data", "--input",
                str(corpus), "--output-prefix", str(Path(scratch) / f"out_{mib}"),
                "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                str(TOKENIZER), "--append-eod", "--workers", str(args.workers)])
            print(f"| {mib} MiB | {documents:,} | {peak:.0f} MiB | {wall:.1f} s | "
                  f"{mib / wall:.1f} |", flush=True)
            corpus.unlink()


if __name__ == "__main__":
    main()
