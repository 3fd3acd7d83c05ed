"""Which data a run reads: Megatron-LM's blends, read as Megatron-LM reads them
(`megatron/training/utils.py:get_blend_and_blend_per_split`, through megatron-core's
`get_blend_from_list`), or our prepared corpus, or megatron-core's mock dataset.

Forms (Megatron-LM's): `--data-path P` (one prefix), `--data-path W1 P1 W2 P2` (weights and
prefixes), `--data-path P1 P2` (every prefix whole, weighted by its size), `--data-args-path
FILE` (the same words in a file), and per split `--train-data-path` / `--valid-data-path` /
`--test-data-path` or `--per-split-data-args-path FILE.json`. Every prefix is checked before
a process group starts: both files there, the index sound, every token id below the
tokenizer's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_gnmr.errors import UserError

Blend = tuple[list[str], "list[float] | None"]
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class DataPlan:
    """The blend (split by --split) or the blends per split; None for both: mock data."""

    blend: Blend | None
    blend_per_split: list[Blend | None] | None
    flag: str  # where the prefixes came from, for messages

    @property
    def prefixes(self) -> list[str]:
        blends = [self.blend] if self.blend else [b for b in self.blend_per_split or [] if b]
        return [prefix for blend in blends for prefix in blend[0]]


def parse_blend(words: list[str], flag: str) -> Blend:
    """megatron-core's reading of a blend list, with its mistakes as one-line errors: an even
    count of words is weight-prefix pairs (every weight a number >= 0, not all 0), an odd
    count is prefixes alone."""
    from megatron.core.datasets.utils import get_blend_from_list

    if not words:
        raise UserError(f"{flag}: give at least one prefix")
    if len(words) % 2 == 0:
        weights = words[0::2]
        numbers = [_number(w) for w in weights]
        if any(n is None for n in numbers):
            bad = next(w for w, n in zip(weights, numbers) if n is None)
            if all(n is None for n in numbers):
                return (list(words), None)  # an even number of bare prefixes
            raise UserError(f"{flag}: {bad!r} is not a weight; give W1 PREFIX1 W2 PREFIX2 ... "
                            "(numbers >= 0) or prefixes alone")
        if any(n < 0 for n in numbers):
            raise UserError(f"{flag}: weight {min(numbers)} is negative; weights are >= 0")
        if sum(numbers) <= 0:
            raise UserError(f"{flag}: the weights add up to 0; at least one must be > 0")
    prefixes, weights = get_blend_from_list(list(words))
    return list(prefixes), None if weights is None else [float(w) for w in weights]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


def plan_from(data) -> DataPlan | None:
    """The run's blends (None: our prepared corpus)."""
    per_split = data.train_data_path or data.valid_data_path or data.test_data_path or \
        data.per_split_data_args_path
    if data.mock_data:
        if data.data_path or per_split or data.data_args_path:
            raise UserError("--mock-data reads no files: drop --data-path and the per-split "
                            "data flags")
        return DataPlan(None, None, "--mock-data")
    if data.data_path or data.data_args_path:
        if per_split:
            raise UserError("--data-path / --data-args-path and the per-split data flags "
                            "(--train-data-path, ..., --per-split-data-args-path) are "
                            "exclusive (Megatron-LM's rule): give one form")
        if data.data_args_path:
            if data.data_path:
                raise UserError("--data-args-path holds --data-path's values: give one")
            words = _read_text(data.data_args_path, "--data-args-path").split()
            return DataPlan(parse_blend(words, f"--data-args-path {data.data_args_path}"),
                            None, "--data-args-path")
        return DataPlan(parse_blend(data.data_path, "--data-path"), None, "--data-path")
    if not per_split:
        return None
    if data.per_split_data_args_path:
        if data.train_data_path or data.valid_data_path or data.test_data_path:
            raise UserError("--per-split-data-args-path holds the per-split paths: give it or "
                            "--train-data-path/--valid-data-path/--test-data-path")
        return DataPlan(None, _per_split_file(data.per_split_data_args_path),
                        "--per-split-data-args-path")
    blends = [parse_blend(words, f"--{split}-data-path") if words else None
              for split, words in zip(SPLITS, (data.train_data_path, data.valid_data_path,
                                               data.test_data_path))]
    for split, blend in zip(SPLITS[:2], blends):
        if blend is None:
            raise UserError(f"--{split}-data-path is missing: a run needs its train and "
                            "valid splits")
    return DataPlan(None, blends, "--train-data-path")


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise UserError(f"{flag} {path}: {error.strerror or error}") from None


def _per_split_file(path: str) -> list[Blend | None]:
    flag = f"--per-split-data-args-path {path}"
    try:
        data = json.loads(_read_text(path, "--per-split-data-args-path"))
    except json.JSONDecodeError as error:
        raise UserError(f"{flag}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"{flag}: the top level must be an object with train, valid, test")
    unknown = sorted(set(data) - set(SPLITS))
    if unknown:
        raise UserError(f"{flag}: unknown key {unknown[0]!r}; the keys are train, valid, test")
    blends = []
    for split in SPLITS:
        value = data.get(split)
        if value is None:
            if split != "test":
                raise UserError(f"{flag}: no {split!r} blend (a run needs train and valid)")
            blends.append(None)
            continue
        words = value.split() if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(w, (str, int, float))
                                                  for w in words):
            raise UserError(f"{flag}: {split!r} must be a list or a space-separated string")
        blends.append(parse_blend([str(w) for w in words], f"{flag} ({split})"))
    return blends


def check_prefixes(plan: DataPlan, vocab_size: int) -> None:
    """Every prefix's tokens in the tokenizer's vocabulary (one line naming the file)."""
    from megatron_gnmr.data.indexed import check_token_range

    for prefix in dict.fromkeys(plan.prefixes):
        check_token_range(prefix, vocab_size, flag=plan.flag)
