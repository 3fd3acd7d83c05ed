"""Every path the user gives, checked before anything is built or written: files of the
wrong kind, directories that are files, places that cannot be written. Each failure is one
UserError naming the flag, the path and the fix.

The data and tokenizer checks open the files (cheaply: the .idx header, the tokenizer model),
so a wrong file fails here in a second instead of minutes later inside megatron.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from megatron_gnmr.errors import UserError


def writable_directory(flag: str, path: str) -> None:
    """`path` is a directory that can be created or written (it need not exist yet)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UserError(f"{flag} {path}: is a file, not a directory")
    existing = next(p for p in [target, *target.parents] if p.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, so the directory cannot be made")
    try:  # a real attempt: permission bits say nothing for root or read-only mounts
        tempfile.TemporaryDirectory(dir=existing, prefix=".megatron-gnmr-check-").cleanup()
    except OSError:
        raise UserError(f"{flag} {path}: {existing} is not writable; choose another "
                        "directory") from None


def check_data(data) -> None:
    """The data flags (blends, per-split paths, mock data), the tokenizer and
    --data-cache-dir: every prefix sound and within the tokenizer's vocabulary."""
    from megatron_gnmr.data.sources import check_prefixes, plan_from

    writable_directory("--data-cache-dir", data.data_cache_dir)
    plan = plan_from(data)
    if plan is None:
        given = [flag for flag, value in (("--tokenizer-model", data.tokenizer_model),
                                          ("--tokenizer-type", data.tokenizer_type)) if value]
        if given:
            raise UserError(f"{' and '.join(given)} goes with --data-path (a prepared corpus "
                            "brings its own tokenizer; --tokenizer-corpus picks another "
                            "corpus's)")
        if not 256 < data.vocab_size <= 65536:
            raise UserError(f"--vocab-size {data.vocab_size}: the tokenizer prepare-data trains "
                            "has 257 to 65536 tokens")
        from megatron_gnmr.data.prepare import check_corpora

        check_corpora(data.corpus, data.tokenizer_corpus)
        if data.tokenizer_corpus == data.corpus:
            raise UserError(f"--tokenizer-corpus {data.tokenizer_corpus} is --corpus "
                            f"{data.corpus}'s own tokenizer: leave the flag out (it names "
                            "another corpus whose tokenizer reads this one)")
        return
    if data.tokenizer_corpus is not None or data.corpus != type(data)().corpus:
        raise UserError("--corpus and --tokenizer-corpus pick a prepared corpus; with "
                        "--data-path the data is yours (give its --tokenizer-model instead)")
    from megatron_gnmr.data.datasets import run_tokenizer
    from megatron_gnmr.data.indexed import check_indexed_dataset

    for prefix in dict.fromkeys(plan.prefixes):  # the files first: a missing one is named
        check_indexed_dataset(prefix, flag=plan.flag)
    tokenizer = run_tokenizer(data, plan) if plan.flag != "--mock-data" or data.tokenizer_type \
        else None
    if tokenizer is None:
        raise UserError("--mock-data needs a tokenizer for its vocabulary: --tokenizer-type "
                        "NullTokenizer --vocab-size N (Megatron-LM's mock setup)")
    check_prefixes(plan, tokenizer.vocab_size)


def check_load(load: str | None) -> None:
    """--load names a run directory or one of its iter_* checkpoints (not a file)."""
    if load is None:
        return
    path = Path(load)
    if not path.exists():
        raise UserError(f"--load {load}: no such directory")
    if not path.is_dir():
        raise UserError(f"--load {load}: is a file; give a run directory (--save of a run) or "
                        "one of its checkpoints/iter_* directories")
    from megatron_gnmr.checkpoints.torch_dist import files as dist_files

    is_run = (path / "checkpoints").is_dir() or (path / dist_files.TRACKER).is_file() or \
        any(dist_files.is_complete(p) for p in path.glob("iter_*"))
    is_checkpoint = (path / "meta.json").is_file() or dist_files.is_complete(path)
    if not is_run and not is_checkpoint:
        raise UserError(f"--load {load}: neither a run directory (checkpoints/, "
                        f"{dist_files.TRACKER} or iter_*/) nor a checkpoint (meta.json or "
                        f"{dist_files.MANIFEST})")


def check_references(references: list[str]) -> None:
    for run_dir in references:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise UserError(f"--monitor-reference {run_dir}: no metrics.jsonl there (a "
                            "reference is the --save directory of a finished healthy run)")
