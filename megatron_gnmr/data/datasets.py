"""Train/valid GPTDatasets through megatron-core's BlendedMegatronDatasetBuilder, and the
deterministic batch order that makes resume exact.

The data position is one integer, `consumed_samples`: step `s` of a run reads global
samples `[s * global_batch, (s + 1) * global_batch)`; a data-parallel rank reads its
contiguous share of each micro-batch. Every pipeline stage reads the same samples (only the
first stage uses the tokens, only the last the labels), which keeps the stages in lockstep
without broadcasting batches.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_gnmr.data.config import DataConfig
from megatron_gnmr.data.prepare import exclusive_lock, prepare_data
from megatron_gnmr.data.sources import DataPlan, plan_from
from megatron_gnmr.data.tokenizers import GPTSentencePiece, TextTokenizer, build_tokenizer
from megatron_gnmr.errors import UserError


@dataclass
class DataSource:
    plan: DataPlan | None  # None: the prepared corpus at `prefix`
    prefix: str | None
    tokenizer: TextTokenizer
    unigram_entropy: float | None  # nats, when known from prepare-data

    @property
    def blend(self):
        return ([self.prefix], None) if self.plan is None else self.plan.blend

    def fingerprint(self) -> str:
        """What a resume checks it reads the same data by (each file's counts and size)."""
        from megatron_gnmr.data.indexed import dataset_fingerprint

        if self.plan is None or len(self.plan.prefixes) == 1:
            return dataset_fingerprint(self.prefix or self.plan.prefixes[0])
        if not self.plan.prefixes:
            return f"mock data, vocabulary {self.tokenizer.vocab_size}"
        return "; ".join(f"{Path(p).name}: {dataset_fingerprint(p)}"
                         for p in self.plan.prefixes)

    @property
    def description(self) -> str:
        """What a resume compares: the prefixes read (their files' fingerprints elsewhere)."""
        if self.plan is None:
            return self.prefix
        return " ".join(self.plan.prefixes) or "mock"


def prepare_default_data(data: DataConfig) -> None:
    """Without --data-path: fetch and prepare --corpus (cached). Run by one rank
    while the others wait (it writes the shared cache)."""
    if plan_from(data) is None:
        prepare_data(data.data_cache_dir, data.vocab_size, quiet=False, corpus=data.corpus,
                     tokenizer_corpus=data.tokenizer_corpus)


def run_tokenizer(data: DataConfig, plan: DataPlan | None) -> TextTokenizer:
    """The tokenizer the flags name (our SentencePiece model beside the first prefix when a
    blend gives no --tokenizer-model)."""
    model = data.tokenizer_model
    if model is None and plan is not None and plan.prefixes and data.tokenizer_type in (
            None, "GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"):
        model = str(Path(plan.prefixes[0]).parent / "tokenizer.model")
    return build_tokenizer(data.tokenizer_type, model, data.vocab_file, data.merge_file,
                           data.vocab_size)


def tokenizer_of(data: DataConfig) -> TextTokenizer:
    """The run's tokenizer alone: the one its flags name, else its prepared corpus's."""
    if data.tokenizer_type is not None:
        return run_tokenizer(data, plan_from(data))
    return resolve_data(data).tokenizer


def resolve_data(data: DataConfig) -> DataSource:
    """The data and tokenizer for this run (after `prepare_default_data`)."""
    plan = plan_from(data)
    if plan is None and data.tokenizer_type is not None:  # an imported model: no data of its
        raise UserError(f"the model's tokenizer (--tokenizer-type {data.tokenizer_type}) "
                        "reads data you give: --data-path (a prepared corpus brings its own "
                        "tokenizer)")
    if plan is None:
        prepared = prepare_data(data.data_cache_dir, data.vocab_size, quiet=True,
                                corpus=data.corpus, tokenizer_corpus=data.tokenizer_corpus)
        return DataSource(None, prepared.prefix, GPTSentencePiece(prepared.tokenizer_model),
                          prepared.meta["unigram_entropy_nats"])
    # The files were checked before the launch (`input_files.check_data`).
    return DataSource(plan, None, run_tokenizer(data, plan), None)


def build_datasets(data: DataConfig, source: DataSource, sequence_length: int, seed: int,
                   train_samples: int, valid_samples: int):
    """(train, valid) datasets with at least the given numbers of samples, built by
    megatron-core's BlendedMegatronDatasetBuilder (GPTDataset, or MockGPTDataset with
    --mock-data)."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    cache = private_index_cache(data.data_cache_dir, data.data_cache_path)
    mock = source.plan is not None and source.plan.blend is None and \
        source.plan.blend_per_split is None
    dataset_config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length,
        blend=None if mock else source.blend,
        blend_per_split=None if source.plan is None else source.plan.blend_per_split,
        split=data.split if source.plan is None or source.plan.blend is not None or mock
        else None,
        tokenizer=source.tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache),
        mmap_bin_files=data.mmap_bin_files,
    )
    if source.plan is None or source.plan.blend is not None and len(source.blend[0]) == 1:
        check_split_has_samples(data.split, source.blend[0][0], sequence_length)
    try:
        with building_alone(cache):
            train, valid, _ = BlendedMegatronDatasetBuilder(
                MockGPTDataset if mock else GPTDataset, [train_samples, valid_samples, 0],
                lambda: True, dataset_config
            ).build()
    except (AssertionError, ValueError, IndexError) as error:
        raise UserError(f"{source.plan.flag if source.plan else '--data-path'} "
                        f"{source.description}: cannot build train/valid datasets with "
                        f"--split {data.split} ({error})") from None
    if train is None or valid is None:
        raise UserError(f"--split {data.split}: needs non-zero train and valid weights")
    return train, valid


def check_split_has_samples(split: str, prefix: str, sequence_length: int) -> None:
    """Each of the train and valid splits must hold one sample (sequence + 1 tokens) of the
    documents megatron gives it: with fewer, megatron's sample index loops over epochs of
    nothing and the run hangs without a word. The document ranges are megatron's own
    (`convert_split_vector_to_split_matrix`, rounded as its builder rounds them)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix, mmap=True)
    lengths = dataset.sequence_lengths.copy()  # a view into the index's mmap, closed with it
    del dataset
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, bookends in zip(("train", "valid"), matrix[:2]):
        begin, end = (int(round(b * len(lengths))) for b in bookends) if bookends else (0, 0)
        tokens = int(lengths[begin:end].sum())
        if tokens < sequence_length + 1:
            raise UserError(f"--split {split}: the {name} split gets documents {begin}..{end} "
                            f"of {len(lengths)} ({tokens} tokens), less than one sample "
                            f"({sequence_length + 1} tokens); give it a larger weight")


def private_index_cache(data_cache_dir: str, data_cache_path: str | None = None) -> Path:
    """Where megatron caches its dataset indices, checked before megatron reads them.

    megatron-core keeps them beside the data by default and reads them with
    `numpy.load(allow_pickle=True)`: whoever can write beside a shared dataset could run code
    in every job that reads it, and a read-only data directory fails. Here they live in
    `<--data-cache-dir>/index-cache`, created private (0700), refused if another user owns it
    or others may write it, and every cached array must be a plain numeric .npy (an object
    array, the only kind that unpickles, is deleted and rebuilt).
    """
    cache = Path(data_cache_path) if data_cache_path else Path(data_cache_dir) / "index-cache"
    flag = "--data-cache-path" if data_cache_path else "--data-cache-dir"
    data_cache_dir = data_cache_path or data_cache_dir
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{flag} {data_cache_dir}: cannot create {cache} "
                        f"({error.strerror}); choose a writable directory") from None
    status = cache.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise UserError(f"{flag} {data_cache_dir}: {cache} is not private (owned by "
                        f"uid {status.st_uid}, mode {oct(status.st_mode & 0o777)}); megatron "
                        "loads its index files with pickle enabled, so it must be yours alone "
                        f"(chmod 700, or choose another {flag})")
    for array in cache.glob("*.npy"):
        if not _plain_npy(array):
            array.unlink()
    return cache


@contextlib.contextmanager
def building_alone(cache: Path):
    """One job at a time builds megatron's indices in a cache: megatron writes them with
    `numpy.save` (not atomically), so two jobs sharing `--data-cache-dir` could read each
    other's half-written files. Only global rank 0 of a job takes the lock: megatron's
    builder makes the other ranks wait at a barrier until rank 0 has written."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        yield
        return
    with exclusive_lock(cache / ".build.lock"):
        yield


def _plain_npy(path: Path) -> bool:
    """A .npy whose header describes a numeric (never pickled) array."""
    try:
        with open(path, "rb") as file:
            version = numpy.lib.format.read_magic(file)
            read_header = (numpy.lib.format.read_array_header_1_0 if version == (1, 0)
                           else numpy.lib.format.read_array_header_2_0)
            _, _, dtype = read_header(file)
    except (OSError, ValueError):
        return False
    return not dtype.hasobject


class BatchReader:
    """Micro-batches for one optimizer step, read by global sample index; with `workers`
    threads, the next step's micro-batches are read while this one trains (in the same order:
    what a step reads never depends on them)."""

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int,
                 workers: int = 0):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="data") if workers else None
        self.ahead: dict[int, list] = {}

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of optimizer step `step` (0-based)."""
        if self.pool is None:
            return [self._micro_batch(step, micro) for micro in range(self.num_microbatches)]
        pending = self.ahead.pop(step, None)
        batches = [f.result() for f in pending] if pending is not None else \
            [self._micro_batch(step, micro) for micro in range(self.num_microbatches)]
        self.ahead = {step + 1: [self.pool.submit(self._micro_batch, step + 1, micro)
                                 for micro in range(self.num_microbatches)]}
        return batches

    def _micro_batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        start = step * self.global_batch_size
        first = start + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
        samples = [self.dataset[(first + i) % len(self.dataset)]
                   for i in range(self.micro_batch_size)]
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in ("tokens", "labels", "loss_mask", "position_ids")}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
