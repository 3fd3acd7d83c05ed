"""The evaluation tasks, as plain functions of token ids and a scorer.

- Perplexity: exp of the mean next-token loss over held-out sequences.
- Cloze (a HellaSwag analogue): a held-out passage's first `context` tokens, its true next
  `continuation` tokens and three continuations taken from passages of other documents; the model
  picks the choice with the highest length-normalised log-likelihood given the context
  (summed log-probability divided by the choice's length in characters, lm-eval-harness's
  `acc_norm`). Chance is 25%. Items are drawn by a fixed seed, so every run of a comparison
  answers the same questions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from megatron_gnmr.errors import UserError

CHOICES = 4


@dataclass(frozen=True)
class ClozeItem:
    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    answer: int  # index of the true continuation in `choices`


def cloze_items(documents: Sequence[Sequence[int]], context: int, continuation: int,
                count: int, seed: int = 0) -> list[ClozeItem]:
    """Up to `count` items. Each held-out document is cut into non-overlapping windows of
    `context + continuation` tokens (from a random offset); an item is a window's context,
    its own continuation and three continuations of windows of other documents."""
    rng = np.random.default_rng(seed)
    length = context + continuation
    windows, owner = [], []
    for number, document in enumerate(documents):
        document = np.asarray(document)
        if len(document) < length:
            continue
        first = int(rng.integers(0, (len(document) - length) % length + 1))
        for start in range(first, len(document) - length + 1, length):
            window = [int(t) for t in document[start: start + length]]
            windows.append((tuple(window[:context]), tuple(window[context:])))
            owner.append(number)
    if len(set(owner)) < CHOICES:
        raise UserError(f"cloze: {len(set(owner))} held-out documents have {length} tokens; "
                        f"need at least {CHOICES} (shorter --context-tokens/"
                        "--continuation-tokens, or more valid data)")
    owner = np.array(owner)
    items = []
    for index in rng.permutation(len(windows))[:count]:
        others = rng.choice(np.flatnonzero(owner != owner[index]), CHOICES - 1, replace=False)
        choices = [windows[i][1] for i in others]
        answer = int(rng.integers(0, CHOICES))
        choices.insert(answer, windows[index][1])
        items.append(ClozeItem(windows[index][0], tuple(choices), answer))
    return items


def choice_score(log_probs: Sequence[float], characters: int) -> float:
    """Length-normalised log-likelihood of one choice (lm-eval-harness's acc_norm)."""
    return float(np.sum(log_probs)) / max(characters, 1)


def cloze_accuracy(items: list[ClozeItem],
                   continuation_log_probs: Callable[[list[tuple[int, ...]], list[tuple[int, ...]]],
                                                    list[np.ndarray]],
                   characters: Callable[[tuple[int, ...]], int]) -> dict:
    """Accuracy of picking the true continuation. `continuation_log_probs(contexts, choices)`
    gives each choice's per-token log-probabilities given its context."""
    contexts = [item.context for item in items for _ in item.choices]
    choices = [choice for item in items for choice in item.choices]
    log_probs = continuation_log_probs(contexts, choices)
    scores = np.array([choice_score(lp, characters(choice))
                       for lp, choice in zip(log_probs, choices)]).reshape(len(items), CHOICES)
    picked = scores.argmax(axis=1)
    correct = picked == np.array([item.answer for item in items])
    return {"accuracy": float(correct.mean()), "items": len(items),
            "stderr": float(correct.std(ddof=1) / np.sqrt(len(items))) if len(items) > 1
            else None}
