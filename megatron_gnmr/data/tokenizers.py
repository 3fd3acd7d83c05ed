"""Megatron-LM's tokenizers (`--tokenizer-type`), with its meaning of each: which ids a text
becomes, which id ends a document (eod) and which one is padding (its tokens are dropped from
the loss by megatron-core's GPTDataset).

The meaning is that of Megatron-LM's default tokenizers since 0.15, megatron-core's
`megatron.core.tokenizers` (what `pretrain_gpt.py` and `tools/preprocess_data.py` build
unless given `--legacy-tokenizer`; read at core_v0.16.1):

| --tokenizer-type | reads | a text becomes | eod | pad |
|---|---|---|---|---|
| (none: ours) | the SentencePiece model prepared beside the data | its pieces | its eos | its pad |
| GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer | --tokenizer-model (.model) | its pieces (no bos) | its eos | its pad |
| HuggingFaceTokenizer | --tokenizer-model: a directory or its tokenizer.json | its tokens, without the template's special tokens | eos_token | pad_token |
| GPT2BPETokenizer | --vocab-file, --merge-file | GPT-2's byte-level BPE | `<|endoftext|>` | none |
| NullTokenizer | --vocab-size N | "1 2 3" -> [1, 2, 3] | N (N + 1 ids) | none |

Hugging Face tokenizers are read with the `tokenizers` library that transformers' fast
tokenizers run on (no transformers at run time, no hub: a local directory or file), and their
special tokens from `tokenizer_config.json` / `special_tokens_map.json` as transformers reads
them. A tokenizer's `bos` (-1: none) is not put into the data (megatron-core's
datasets never add it); an evaluation conditions a document's first token on it as
transformers' models do (lm-eval's HFLM), and export-hf declares it. The legacy tokenizers
(`--legacy-tokenizer`: a bos for Llama2Tokenizer, added `<EOD>` tokens for
SentencePieceTokenizer) are not offered.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gnmr.errors import UserError

SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer")
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")
NO_PAD = -1  # megatron-core's GPTDataset: no id is padding
NO_BOS = -1


class TextTokenizer:
    """What the data pipeline and prepare-data read from any tokenizer."""

    kind = ""
    vocab_size: int
    eod: int
    pad: int = NO_PAD
    bos: int = NO_BOS
    files: tuple[Path, ...] = ()  # what a checkpoint or an export carries to rebuild it

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids transformers' tokenizer of our export gives for `text` (with
        `add_special_tokens`, its default: the tokenizer's own template too, which `encode`
        leaves out as megatron-core does). Only a Hugging Face tokenizer has a template."""
        return self.encode(text)

    def special_text(self, token_id: int) -> str | None:
        """A special token's text as transformers decodes it (None: not known here)."""
        return None

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    @property
    def unique_identifiers(self) -> dict:
        """What megatron-core's dataset cache hashes the tokenizer by."""
        return {"class": self.kind, "files": [p.name for p in self.files],
                "vocab_size": self.vocab_size}

    @property
    def eos(self) -> int:
        return self.eod


def _sentencepiece(path: Path, flag: str):
    import sentencepiece

    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file (a SentencePiece .model; run "
                        "`megatron-gnmr prepare-data`, or pass --tokenizer-model)")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as error:
        raise UserError(f"{flag} {path}: not a SentencePiece model "
                        f"({str(error).splitlines()[0][:120]})") from None


class GPTSentencePiece(TextTokenizer):
    """A SentencePiece model as megatron-core's tokenizers read one (our prepared tokenizer,
    and Megatron-LM's three SentencePiece types)."""

    kind = "GPTSentencePieceTokenizer"

    def __init__(self, model: str | Path, flag: str = "--tokenizer-model",
                 kind: str | None = None):
        self.kind = kind or self.kind
        self.model_path = Path(model)
        self._sp = _sentencepiece(self.model_path, flag)
        self.files = (self.model_path,)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.pad = self._sp.pad_id()
        self.bos = self._sp.bos_id()
        if self.eod < 0:
            raise UserError(f"{flag} {model}: the SentencePiece model has no eos id, which "
                            f"{self.kind} ends documents with")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class HuggingFace(TextTokenizer):
    """A Hugging Face tokenizer from local files: a directory (tokenizer.json and, for its
    special tokens, tokenizer_config.json / special_tokens_map.json) or a tokenizer.json."""

    kind = "HuggingFaceTokenizer"

    def __init__(self, location: str | Path, flag: str = "--tokenizer-model"):
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(location)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"{flag} {location}: no tokenizer.json there (a Hugging Face "
                            "tokenizer: its directory or its tokenizer.json; no hub is "
                            "reached from here)")
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as error:  # the library raises a bare Exception on bad JSON
            raise UserError(f"{flag} {file}: not a Hugging Face tokenizer "
                            f"({str(error).splitlines()[0][:120]})") from None
        directory = file.parent
        specials = _special_tokens(directory)
        self.files = tuple(p for p in (file, directory / "tokenizer_config.json",
                                       directory / "special_tokens_map.json") if p.is_file())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = specials.get("eos_token")
        if eos is None or self._tok.token_to_id(eos) is None:
            raise UserError(f"{flag} {location}: the tokenizer names no eos_token in its "
                            "vocabulary (tokenizer_config.json or special_tokens_map.json); "
                            "documents end with it")
        self.eod = self._tok.token_to_id(eos)
        self.pad = self._special_id(specials.get("pad_token"), NO_PAD)
        self.bos = self._special_id(specials.get("bos_token"), NO_BOS)

    def _special_id(self, token: str | None, missing: int) -> int:
        found = self._tok.token_to_id(token) if token else None
        return missing if found is None else found

    def encode(self, text: str) -> list[int]:
        # megatron-core's HuggingFaceTokenizer.text_to_ids: the tokens alone, no template
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # transformers' fast tokenizer runs the same tokenizer.json, template included
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def special_text(self, token_id: int) -> str | None:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _special_tokens(directory: Path) -> dict[str, str]:
    """{eos_token: text, ...} as transformers reads them (the config's, then the map's)."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{path}: not valid JSON ({error})") from None
        except RecursionError:  # nested deeper than the parser goes
            raise UserError(f"{path}: nested too deeply to be a tokenizer's settings") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: a {type(data).__name__}, not a JSON object of settings")
        for key in ("eos_token", "pad_token", "bos_token"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


class GPT2BPE(TextTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from --vocab-file and
    --merge-file; documents end with <|endoftext|>."""

    kind = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if path is None or not Path(path).is_file():
                raise UserError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's "
                                f"{'vocab.json' if 'vocab' in flag else 'merges.txt'}); "
                                f"{path or 'not given'}: no such file")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:
            raise UserError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not "
                            f"GPT-2 BPE files ({str(error).splitlines()[0][:120]})") from None
        self._tok = RustTokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.files = (Path(vocab_file), Path(merge_file))
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise UserError(f"--vocab-file {vocab_file}: no <|endoftext|> token, which "
                            "GPT2BPETokenizer ends documents with")
        self.eod = eod
        self.bos = eod  # GPT-2's one special token begins texts too (its bos_token_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class Null(TextTokenizer):
    """Megatron-LM's NullTokenizer (with --mock-data): text is space-separated ids; the eod is
    the id after the vocabulary."""

    kind = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_tokenizer(tokenizer_type: str | None, tokenizer_model: str | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None) -> TextTokenizer:
    """The tokenizer a run or prepare-data names (`None`: our SentencePiece model at
    `tokenizer_model`)."""
    kind = tokenizer_type or GPTSentencePiece.kind
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size")
        return Null(vocab_size)
    if kind == "GPT2BPETokenizer":
        return GPT2BPE(vocab_file, merge_file)
    if tokenizer_model is None:
        raise UserError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if kind in SENTENCEPIECE_TYPES:
        return GPTSentencePiece(tokenizer_model, kind=kind)
    if kind == HuggingFace.kind:
        return HuggingFace(tokenizer_model)
    raise UserError(f"--tokenizer-type {kind}: use one of {', '.join(TOKENIZER_TYPES)}")
