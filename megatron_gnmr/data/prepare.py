"""`prepare-data`: corpus -> SentencePiece tokenizer -> Megatron .bin/.idx, all cached.

Output, under `<cache>/<name>-v<vocab>/`: `tokenizer.model`, `text_document.{bin,idx}` and
`meta.json` (token count, documents, unigram entropy). `meta.json` is written last, so its
presence means the directory is complete and a second run does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from megatron_gnmr.data.corpus import shakespeare_documents, user_documents
from megatron_gnmr.data.indexed import write_indexed_dataset
from megatron_gnmr.data.tokenizer import Tokenizer, train_tokenizer
from megatron_gnmr.errors import UserError

LINES_PER_DOCUMENT = 120  # a scene-sized chunk, so the valid split is not two whole plays


@dataclass(frozen=True)
class PreparedData:
    directory: Path

    @property
    def prefix(self) -> str:
        return str(self.directory / "text_document")

    @property
    def tokenizer_model(self) -> Path:
        return self.directory / "tokenizer.model"

    @property
    def meta(self) -> dict:
        return json.loads((self.directory / "meta.json").read_text())


def dataset_directory(cache_dir: str, vocab_size: int, inputs: list[str] | None) -> Path:
    if not inputs:
        name = "shakespeare"
    else:
        fingerprint = hashlib.sha1()
        for path in sorted(inputs):
            stat = Path(path).stat() if Path(path).exists() else None
            fingerprint.update(f"{Path(path).resolve()}:{stat and stat.st_size}:"
                               f"{stat and stat.st_mtime_ns}".encode())
        name = f"user-{fingerprint.hexdigest()[:10]}"
    return Path(cache_dir) / f"{name}-v{vocab_size}"


def prepare_data(cache_dir: str, vocab_size: int = 4096, inputs: list[str] | None = None,
                 quiet: bool = False) -> PreparedData:
    """Fetch, tokenize and index a corpus unless the cache already holds it."""
    if not 256 < vocab_size <= 65536:
        raise UserError(f"--vocab-size must be in (256, 65536], got {vocab_size}")
    directory = dataset_directory(cache_dir, vocab_size, inputs)
    prepared = PreparedData(directory)
    if (directory / "meta.json").exists():
        if not quiet:
            print(f"prepare-data: cached, nothing to do ({directory})")
        return prepared

    say = (lambda *a: None) if quiet else print
    say(f"prepare-data: reading {'shakespeare' if not inputs else ', '.join(inputs)}")
    texts = list(user_documents(inputs)) if inputs else shakespeare_documents(Path(cache_dir))
    documents = [chunk for text in texts for chunk in _chunks(text)]
    if not documents:
        raise UserError("prepare-data: the input holds no text")
    say(f"prepare-data: training a BPE tokenizer, vocab {vocab_size}")
    train_tokenizer(documents, prepared.tokenizer_model, vocab_size)
    tokenizer = Tokenizer(prepared.tokenizer_model)

    counts: Counter[int] = Counter()

    def encoded():
        for document in tqdm(documents, desc="tokenizing", unit="doc", disable=quiet):
            ids = tokenizer.encode(document) + [tokenizer.eod]
            counts.update(ids)
            yield ids

    tokens = write_indexed_dataset(encoded(), Path(prepared.prefix))
    meta = {
        "documents": len(documents),
        "tokens": tokens,
        "characters": sum(len(d) for d in documents),
        "vocab_size": tokenizer.vocab_size,
        "unigram_entropy_nats": _entropy(counts),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    say(f"prepare-data: {tokens:,} tokens in {len(documents)} documents -> {prepared.prefix}")
    return prepared


def _chunks(text: str):
    lines = text.splitlines(keepends=True)
    for start in range(0, len(lines), LINES_PER_DOCUMENT):
        chunk = "".join(lines[start : start + LINES_PER_DOCUMENT])
        if chunk.strip():
            yield chunk


def _entropy(counts: Counter) -> float:
    """Unigram entropy in nats: the loss of a model that ignores context."""
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-cache-dir", default=".cache/megatron_gnmr",
                        help="where corpora, tokenizer and .bin/.idx are cached")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help="your own .txt / .jsonl files instead of the Shakespeare corpus")


def run(args: argparse.Namespace) -> None:
    prepared = prepare_data(args.data_cache_dir, args.vocab_size, args.input)
    print(json.dumps({"data_path": prepared.prefix,
                      "tokenizer_model": str(prepared.tokenizer_model), **prepared.meta}))
