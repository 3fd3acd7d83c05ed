"""Write the shipped lm-eval tasks' items (megatron_gnmr/evaluation/lm_eval_tasks/
shakespeare_cloze.jsonl and shakespeare_passages.jsonl) from the prepared Shakespeare corpus
(`megatron-gnmr prepare-data`).

The items are evaluate's own cloze (evaluation/tasks.py: a passage's first tokens, its true
continuation and three continuations from other documents) drawn from the corpus's last
documents and written as text, short enough (40 + 12 tokens) for the tiny models' 64-token
context; the passages (for a perplexity task) are 160 tokens, so lm-eval's rolling
windows cut each into several at that context. Smoke tasks to prove the lm-eval path, not
benchmarks: their passages may be in a run's training split.

    python scripts/make_lm_eval_tasks.py [--items 64]
"""

import argparse
import json
from pathlib import Path

from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_gnmr.data.tokenizers import GPTSentencePiece
from megatron_gnmr.evaluation.tasks import cloze_items

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / ".cache" / "megatron_gnmr" / "shakespeare-v4096"
TASKS = REPO / "megatron_gnmr" / "evaluation" / "lm_eval_tasks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--passages", type=int, default=16)
    parser.add_argument("--documents", type=int, default=40, help="the corpus's last N")
    args = parser.parse_args()
    tokenizer = GPTSentencePiece(CORPUS / "tokenizer.model")
    corpus = IndexedDataset(str(CORPUS / "text_document"))
    documents = [corpus[i] for i in range(len(corpus) - args.documents, len(corpus))]
    with (TASKS / "shakespeare_cloze.jsonl").open("w") as out:
        for item in cloze_items(documents, 40, 12, args.items, seed=0):
            out.write(json.dumps({"context": tokenizer.decode(list(item.context)),
                                  "choices": [tokenizer.decode(list(c)) for c in item.choices],
                                  "answer": item.answer}) + "\n")
    with (TASKS / "shakespeare_passages.jsonl").open("w") as out:
        for document in documents[: args.passages]:
            out.write(json.dumps({"text": tokenizer.decode([int(t) for t in document[:160]])})
                      + "\n")
    print(f"{args.items} cloze items, {args.passages} passages -> {TASKS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
