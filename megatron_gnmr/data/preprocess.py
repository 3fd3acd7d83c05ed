"""`prepare-data --output-prefix P`: Megatron-LM's `tools/preprocess_data.py`, at any corpus
size, with the bytes it writes.

Each document of the input (a line of a `.jsonl`, `.jsonl.gz`, or a whole `.txt` file) is
tokenized by `--workers` processes with a Megatron-LM tokenizer (`data/tokenizers.py`), and
written per JSON key to `P_<key>_document.bin/.idx` as that tool writes them: megatron-core's
IndexedDatasetBuilder with the dtype it picks for the vocabulary, one sequence per document,
the eod appended with `--append-eod` (not to an empty document, which still gets its empty
entry in the index). `tests/test_preprocess.py` compares the bytes with the tool's own output
on a committed input.

Memory does not grow with the corpus: the input is read as a stream, a bounded window of
documents at a time (`WINDOW` per worker) goes to the workers, and their results are written
before the next window is read (the tool itself hands the whole file to a pool that reads
ahead without bound). Output goes to temporary names, renamed when complete.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from megatron_gnmr.errors import UserError

WINDOW = 256  # documents per worker in flight


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else \
        open(path, encoding="utf-8")


def _documents(inputs: list[Path], keys: list[str]) -> Iterator[tuple[dict, int]]:
    """({key: text}, bytes read) per document, as a stream."""
    for path in inputs:
        if path.suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            yield {key: text for key in keys}, len(text.encode())
            continue
        with _open(path) as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UserError(f"--input {path}: line {number} is not JSON "
                                    f"({error.msg})") from None
                missing = [key for key in keys if key not in record]
                if missing or not all(isinstance(record[key], (str, list)) for key in keys):
                    raise UserError(f"--input {path}: line {number} has no text under "
                                    f"{', '.join(missing or keys)} (--json-keys)")
                yield {key: record[key] for key in keys}, len(line.encode())


_WORKER_TOKENIZER = None


def _worker_pool(workers: int, tokenizer_args: dict):
    """The tokenizing processes, forked where the platform forks, with SIGTERM's default
    action: a forked worker inherits its parent's handlers, and one that only notes SIGTERM
    (a training run's preemption handler, in a process that trained before) survives the
    pool's terminate(), whose join then waits forever."""
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    if threading.current_thread() is not threading.main_thread():
        return context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_args,))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return context.Pool(workers, initializer=_start_worker, initargs=(tokenizer_args,))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_worker(tokenizer_args: dict) -> None:
    global _WORKER_TOKENIZER
    from megatron_gnmr.data.tokenizers import build_tokenizer

    _WORKER_TOKENIZER = build_tokenizer(**tokenizer_args)


def _encode(document: dict, append_eod: bool = False) -> dict:
    """{key: (ids, sentence lengths)} as the tool's `Encoder.encode`: a list is sentences."""
    out = {}
    for key, text in document.items():
        ids, lengths = [], []
        for sentence in (text if isinstance(text, list) else [text]):
            sentence_ids = _WORKER_TOKENIZER.encode(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and append_eod:
            ids.append(_WORKER_TOKENIZER.eod)
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return out


def _encode_appending_eod(document: dict) -> dict:
    return _encode(document, append_eod=True)


def output_files(prefix: str, key: str) -> tuple[Path, Path]:
    return Path(f"{prefix}_{key}_document.bin"), Path(f"{prefix}_{key}_document.idx")


def preprocess(inputs: list[str], output_prefix: str, tokenizer_args: dict,
               json_keys: list[str], append_eod: bool, workers: int,
               quiet: bool = False) -> dict:
    """Tokenize `inputs` into `<output_prefix>_<key>_document.{bin,idx}`; returns counts."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_gnmr.data.tokenizers import build_tokenizer

    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise UserError(f"--input {path}: no such file")
    if workers < 1:
        raise UserError(f"--workers {workers}: give at least 1")
    tokenizer = build_tokenizer(**tokenizer_args)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    partial = {key: [f.with_name(f.name + ".partial") for f in output_files(output_prefix, key)]
               for key in json_keys}
    builders = {key: IndexedDatasetBuilder(str(partial[key][0]), dtype=dtype)
                for key in json_keys}
    total_bytes = sum(p.stat().st_size for p in paths)
    counts = {"documents": 0, "tokens": 0}
    encode = _encode_appending_eod if append_eod else _encode
    with _worker_pool(workers, tokenizer_args) as pool, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
                 disable=quiet) as progress:
        window: list[tuple[dict, int]] = []
        for document in _documents(paths, json_keys):
            window.append(document)
            if len(window) == WINDOW * workers:
                _write(pool, encode, window, builders, counts, progress)
                window = []
        _write(pool, encode, window, builders, counts, progress)
    for key, builder in builders.items():
        builder.finalize(str(partial[key][1]))
        for part, final in zip(partial[key], output_files(output_prefix, key)):
            part.replace(final)
    return {**counts, "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name,
            "outputs": [str(output_files(output_prefix, key)[0])[:-4] for key in json_keys]}


def _write(pool, encode, window, builders, counts, progress) -> None:
    if not window:
        return
    for encoded in pool.map(encode, [document for document, _ in window], chunksize=32):
        for key, (ids, lengths) in encoded.items():
            builders[key].add_document(ids, lengths)
            counts["tokens"] += len(ids)
        counts["documents"] += 1
    progress.update(sum(size for _, size in window))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tool's own flags (the tokenizer's are prepare-data's: --tokenizer-type, ...)."""
    parser.add_argument("--output-prefix", default=None, help="Megatron-LM's preprocess_data: "
                        "write PREFIX_<key>_document.bin/.idx from --input with the tokenizer "
                        "--tokenizer-type names (without it: a registry corpus or your files, "
                        "with a tokenizer trained on them, cached)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="the JSON keys of a .jsonl line to tokenize (one output each)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the tokenizer's eod id")
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1),
                        help="tokenizing processes (default: one per core)")
