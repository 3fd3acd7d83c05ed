"""`megatron-gnmr evaluate RUN_DIR --tasks ppl,cloze,retention`: downstream scores of any run.

- `ppl`: held-out perplexity on the run's own validation split.
- `cloze`: 4-way cloze accuracy on passages of that split (`tasks.py`).
- `retention` (LoRA fine-tunes): the loss on the base's corpus (its validation split), and
  how much higher it is than the base's own (the adapters switched off, same precision).
A fine-tune also reports `base/ppl` and `base/cloze_accuracy` (adapters off), so its row
says what fine-tuning changed. Written to RUN_DIR/evaluation.json (the run's low-cost
precision, as it would be deployed) or, with `--exact`, RUN_DIR/evaluation-exact.json (every
unit on the recovery path: a LoRA model merged into its BF16 base); the report and
`reproduce` read them. Printed too.

`--lm-eval TASKS` runs lm-eval-harness tasks instead, on the same model through our own
forward (`lm_eval_run.py`): RUN_DIR/lm_eval.json (lm_eval-exact.json with `--exact`).
`--log-samples` writes the record of every sample behind the scores beside the results
(`sample_log.py`), as lm-eval's `--log_samples` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import numpy as np

from megatron_gnmr.errors import UserError
from megatron_gnmr.evaluation import output_name
from megatron_gnmr.evaluation.loaded_run import LoadedRun, load_run, run_config
from megatron_gnmr.evaluation.tasks import CHOICES, choice_score, cloze_accuracy, cloze_items

TASKS = ("ppl", "cloze", "retention")


def mean_loss(run: LoadedRun, valid, sequences: int, records: list | None = None) -> float:
    """The mean loss over the first `sequences` held-out sequences' scored positions; with
    `records`, each sequence's own (doc_id, tokens, loss) appended to it."""
    import torch

    total, count = 0.0, 0
    for start in range(0, min(sequences, len(valid)), run.batch):
        samples = [valid[i] for i in range(start, min(start + run.batch, sequences, len(valid)))]
        tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
        labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
        mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float()
        losses = run.losses(tokens, labels)
        total += float((losses * mask).sum())
        count += float(mask.sum())
        if records is not None:
            for row, (row_losses, row_mask) in enumerate(zip(losses.double(), mask.double())):
                tokens_scored = float(row_mask.sum())
                records.append({"doc_id": start + row, "tokens": int(tokens_scored),
                                "loss": float((row_losses * row_mask).sum())
                                / max(tokens_scored, 1.0)})
    return total / max(count, 1.0)


def held_out_items(valid, args) -> list:
    """The cloze questions from the held-out documents (the same for every view and run)."""
    documents = [valid.dataset[int(index)] for index in np.unique(valid.indices)]
    return cloze_items(documents, args.context_tokens, args.continuation_tokens,
                       args.cloze_items, seed=0)


def cloze(run: LoadedRun, items: list, records: list | None = None) -> dict:
    """The cloze figures; with `records`, each item's choices and their scores appended."""
    scored = []

    def log_probs(contexts, choices):
        losses = run.token_losses([list(c) + list(x) for c, x in zip(contexts, choices)])
        scored.extend(-loss[len(c) - 1:] for loss, c in zip(losses, contexts))
        return scored[-len(contexts):]

    decode = run.data.tokenizer.decode
    figures = cloze_accuracy(items, log_probs, lambda choice: len(decode(list(choice))))
    if records is not None:
        for number, item in enumerate(items):
            choice_log_probs = scored[number * CHOICES:(number + 1) * CHOICES]
            characters = [len(decode(list(choice))) for choice in item.choices]
            scores = [choice_score(lp, n) for lp, n in zip(choice_log_probs, characters)]
            picked = int(np.argmax(scores))
            records.append({"doc_id": number, "context": decode(list(item.context)),
                            "choices": [decode(list(choice)) for choice in item.choices],
                            "answer": item.answer, "picked": picked,
                            "correct": picked == item.answer,
                            "log_likelihoods": [float(np.sum(lp)) for lp in choice_log_probs],
                            "characters": characters})
    return figures


def evaluate(run: LoadedRun, tasks: list[str], args, samples: list | None = None) -> dict:
    """The scores of `tasks`; with `samples`, the record of each sample behind them appended
    to it (sample_log.py)."""
    from megatron_gnmr.lora.adapters import adapters_disabled

    def logged(task: str, tags: dict, records: list) -> None:
        if samples is not None:
            samples.extend({"task": task, **tags, **record} for record in records)

    results: dict = {"run": str(run.run_dir), "tasks": tasks, "exact": args.exact}
    valid = run.valid_split(sequences=max(args.ppl_sequences, 1), seed=args.heldout_seed)
    items = held_out_items(valid, args) if "cloze" in tasks else []
    views = [("", contextlib.nullcontext)]
    if run.base_run is not None:
        views.append(("base/", lambda: adapters_disabled(run.model)))
    for prefix, view in views:
        tags = {"view": prefix.rstrip("/") or "run"}
        with view():
            if "ppl" in tasks:
                records: list = []
                loss = mean_loss(run, valid, args.ppl_sequences, records)
                results[f"{prefix}loss"], results[f"{prefix}ppl"] = loss, math.exp(loss)
                logged("ppl", tags, [{**r, "ppl": math.exp(r["loss"])} for r in records])
            if "cloze" in tasks:
                records = []
                figures = cloze(run, items, records)
                results[f"{prefix}cloze_accuracy"] = figures["accuracy"]
                results[f"{prefix}cloze_stderr"] = figures["stderr"]
                results["cloze_items"] = figures["items"]
                logged("cloze", tags, records)
    if "retention" in tasks and run.base_run is not None:
        base_valid = run.valid_split(run_config(run.base_run), args.ppl_sequences,
                                     args.heldout_seed)
        tuned, base = [], []
        loss = mean_loss(run, base_valid, args.ppl_sequences, tuned)
        with adapters_disabled(run.model):
            base_loss = mean_loss(run, base_valid, args.ppl_sequences, base)
        results.update({"retention/loss": loss, "retention/base_loss": base_loss,
                        "retention/loss_increase": loss - base_loss})
        logged("retention", {}, [{**t, "base_loss": b["loss"]} for t, b in zip(tuned, base)])
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (--save of a run)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: "
                        + ", ".join(TASKS) + " (retention: LoRA fine-tunes only)")
    parser.add_argument("--ppl-sequences", type=int, default=64,
                        help="held-out sequences for the perplexity")
    parser.add_argument("--cloze-items", type=int, default=400, help="cloze questions")
    parser.add_argument("--heldout-seed", type=int, default=0, help="which held-out sequences "
                        "the perplexity reads, and in what order (the same for every run; the "
                        "run's --seed reproduces its own validation)")
    parser.add_argument("--context-tokens", type=int, default=96)
    parser.add_argument("--continuation-tokens", type=int, default=32)
    parser.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                        help="held-out text from these indexed files (a blend in Megatron-LM's "
                        "form, tokenized with the run's tokenizer) instead of the run's own "
                        "data: what an imported model (import-hf) is evaluated on")
    parser.add_argument("--exact", action="store_true", help="every unit on the recovery path "
                        "(default: the run's low-cost path, the precision it would deploy in)")
    parser.add_argument("--lm-eval", default=None, metavar="TASKS", help="comma-separated "
                        "lm-eval-harness tasks to run instead of --tasks (shipped, from local "
                        "files: shakespeare_cloze, shakespeare_passages; needs pip install "
                        "'megatron-gnmr[eval]')")
    parser.add_argument("--lm-eval-include", nargs="+", default=[], metavar="DIR",
                        help="folders of your own lm-eval task YAMLs")
    parser.add_argument("--lm-eval-limit", type=int, default=None, metavar="N",
                        help="the first N documents of each lm-eval task")
    parser.add_argument("--log-samples", action="store_true", help="also write the record of "
                        "every sample behind the scores (lm-eval's --log_samples) to a JSONL "
                        "file beside the results: evaluation_samples.jsonl, "
                        "lm_eval_samples.jsonl (-exact with --exact)")


def run(args: argparse.Namespace) -> dict:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UserError(f"--tasks {args.tasks!r}: use some of {', '.join(TASKS)}")
    for flag, value in (("--ppl-sequences", args.ppl_sequences),
                        ("--cloze-items", args.cloze_items),
                        ("--context-tokens", args.context_tokens),
                        ("--continuation-tokens", args.continuation_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not Path(args.run_dir).is_dir():
        raise UserError(f"evaluate {args.run_dir}: no such directory")
    if getattr(args, "lm_eval", None) is not None:
        return run_lm_eval(args)
    config = run_config(Path(args.run_dir))
    if args.context_tokens + args.continuation_tokens > config.model.seq_length + 1:
        raise UserError(f"--context-tokens + --continuation-tokens must be at most the run's "
                        f"--seq-length + 1 ({config.model.seq_length + 1})")
    samples = [] if getattr(args, "log_samples", False) else None
    results = evaluate(load_run(args.run_dir, args.exact, getattr(args, "data_path", None)),
                       tasks, args, samples)
    from megatron_gnmr.training.distributed import is_logging_rank, shutdown

    if is_logging_rank():
        (Path(args.run_dir) / output_name(args.exact)).write_text(json.dumps(results, indent=2))
        for key, value in results.items():
            if isinstance(value, float):
                print(f"{key:28s} {value:.4f}")
        if samples is not None:
            _write_samples(args.run_dir, output_name(args.exact), samples)
    shutdown()
    return results


def run_lm_eval(args: argparse.Namespace) -> dict:
    from megatron_gnmr.evaluation import lm_eval_run
    from megatron_gnmr.training.distributed import is_logging_rank, shutdown

    if args.lm_eval_limit is not None and args.lm_eval_limit < 1:
        raise UserError(f"--lm-eval-limit must be >= 1, got {args.lm_eval_limit}")
    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    manager = lm_eval_run.check_tasks(tasks, args.lm_eval_include)
    run_config(Path(args.run_dir))  # a run directory, before anything is built
    log_samples = getattr(args, "log_samples", False)
    results = lm_eval_run.evaluate_with_lm_eval(load_run(args.run_dir, args.exact), tasks,
                                                manager, args.lm_eval_limit, log_samples)
    samples = results.pop("samples", None)
    results.update(run=str(args.run_dir), exact=args.exact)
    if is_logging_rank():
        name = "lm_eval-exact.json" if args.exact else "lm_eval.json"
        (Path(args.run_dir) / name).write_text(json.dumps(results, indent=2, default=str))
        print(lm_eval_run.table(results))
        if log_samples:
            from lm_eval.utils import handle_non_serializable

            from megatron_gnmr.evaluation.sample_log import lm_eval_records

            _write_samples(args.run_dir, name, lm_eval_records(samples or {}),
                           handle_non_serializable)
    shutdown()
    return results


def _write_samples(run_dir: str, results_name: str, records, default=None) -> None:
    from megatron_gnmr.evaluation.sample_log import samples_path, write_samples

    path = samples_path(run_dir, results_name)
    print(f"samples: {path} ({write_samples(path, records, default)} records, one a line)")
