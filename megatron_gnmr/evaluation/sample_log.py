"""`evaluate --log-samples`: one JSON record a line for every sample a score was computed
from, written beside the results, so that a score can be traced to the documents behind it
(lm-eval's `--log_samples`).

The file is the results file's name with `_samples.jsonl`: RUN_DIR/evaluation_samples.jsonl
(the native tasks), RUN_DIR/lm_eval_samples.jsonl (`--lm-eval`), `-exact` in both with
`--exact`. An lm-eval task's records are lm-eval's own, sanitized as its EvaluationTracker
writes them (`samples_<task>_<date>.jsonl`), with the task's name added, since one file holds
every task. The native tasks' records (`command.py` fills them):

- ppl: `view` ("run", or "base": a fine-tune's adapters off), `doc_id` (the held-out order
  of --heldout-seed), `tokens` (scored positions), `loss` (their mean), `ppl`;
- cloze: `view`, `doc_id`, `context`, `choices` (text), `answer`, `picked`, `correct`,
  `log_likelihoods` (each choice's summed log-probability), `characters` (its length, the
  normaliser of acc_norm);
- retention: `doc_id`, `tokens`, `loss` and `base_loss` on the base's corpus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator


def samples_path(run_dir: str | Path, results_name: str) -> Path:
    """Where the samples behind RUN_DIR/`results_name` go."""
    return Path(run_dir) / (Path(results_name).stem + "_samples.jsonl")


def write_samples(path: Path, records: Iterable[dict],
                  default: Callable[[object], object] | None = None) -> int:
    """Write the records as JSON lines (to a temporary name, renamed when complete, so a
    reader never sees half a file), `default` serializing what JSON cannot; the count."""
    partial = path.with_name(path.name + ".partial")
    count = 0
    with partial.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, default=default, ensure_ascii=False) + "\n")
            count += 1
    partial.replace(path)
    return count


def lm_eval_records(samples: dict[str, list[dict]]) -> Iterator[dict]:
    """lm-eval's per-sample records of each task, as its EvaluationTracker writes them:
    `arguments` as {gen_args_i: {arg_j: ...}}, `resps` and `filtered_resps` with every leaf a
    string, `target` a string (lm-eval 0.4's save_results_samples)."""
    from lm_eval.utils import sanitize_list

    for task, records in samples.items():
        for sample in records:
            arguments = {f"gen_args_{i}": {f"arg_{j}": value for j, value in enumerate(arg)}
                         for i, arg in enumerate(sample["arguments"])}
            yield {"task": task, **sample, "arguments": arguments,
                   "resps": sanitize_list(sample["resps"]),
                   "filtered_resps": sanitize_list(sample["filtered_resps"]),
                   "target": str(sample["target"])}
