"""`evaluate --log-samples`: the record of every sample behind the scores, in a JSONL file
beside the results, judged by outside references.

- `--lm-eval`: the file holds what lm-eval's own `--log_samples` writes (its
  EvaluationTracker, run on lm-eval's samples of the same tasks through transformers on the
  fp32 export): the same records, key for key, with the scores within 1e-4;
- the native tasks: each held-out sequence's loss is transformers' loss on that sequence
  (within the logits' bound, 1e-5 relative), each cloze choice's log-likelihood is
  transformers' summed log-probability of its tokens given the context (within 1e-4), and the
  records' fraction correct is the reported accuracy.
"""

import json
import math
from argparse import Namespace

import pytest
import torch

from tests.helpers import TINY, pretrain_in_process
from tests.test_hf_interop import cli

pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (pip install -e .[dev])")
pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

TASKS = ["shakespeare_cloze", "shakespeare_passages"]
LIMIT = 6


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("log_samples")
    assert pretrain_in_process([*TINY, "--train-iters", "4", "--eval-interval", "100",
                                "--save", str(root / "run")]) == 0
    assert cli("export-hf", str(root / "run"), str(root / "hf"), "--dtype", "fp32") == 0
    return root


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(ours, theirs, where: str) -> None:
    """Equal, except numbers (lm-eval writes responses as strings) within 1e-4."""
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs), where
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    else:
        try:
            a, b = float(ours), float(theirs)
        except (TypeError, ValueError):
            assert ours == theirs, where
            return
        assert a == pytest.approx(b, abs=1e-4), where


def test_lm_eval_samples_are_what_lm_eval_logs(exported, tmp_path):
    from lm_eval.loggers import EvaluationTracker

    from megatron_gnmr.evaluation import lm_eval_run

    run = exported / "run"
    assert cli("evaluate", str(run), "--exact", "--lm-eval", ",".join(TASKS),
               "--lm-eval-limit", str(LIMIT), "--log-samples") == 0
    results = json.loads((run / "lm_eval-exact.json").read_text())
    assert "samples" not in results and set(results["results"]) == set(TASKS)
    ours = _read_jsonl(run / "lm_eval-exact_samples.jsonl")

    hf = ("hf", {"pretrained": str(exported / "hf"), "dtype": "float32", "device": "cpu",
                 "batch_size": 4})
    theirs = lm_eval_run.evaluate_with_lm_eval(hf, TASKS, lm_eval_run.check_tasks(TASKS, []),
                                               LIMIT, samples=True)
    tracker = EvaluationTracker(output_path=str(tmp_path / "results.json"))
    tracker.date_id = "reference"  # set by save_results_aggregated, which lm-eval calls first
    for task in TASKS:
        tracker.save_results_samples(task, theirs["samples"][task])
        (written,) = tmp_path.glob(f"samples_{task}_*.jsonl")
        judge = _read_jsonl(written)
        mine = [{k: v for k, v in r.items() if k != "task"} for r in ours if r["task"] == task]
        assert len(mine) == len(judge) == LIMIT
        for number, (a, b) in enumerate(zip(mine, judge)):
            _same(a, b, f"{task}[{number}]")
    # each cloze record's own metric, averaged by hand, is the accuracy reported
    accuracy = sum(r["acc"] for r in ours if r["task"] == "shakespeare_cloze") / LIMIT
    assert accuracy == pytest.approx(results["results"]["shakespeare_cloze"]["acc,none"])


def _choice_log_likelihood(model, context: list[int], choice: list[int]) -> float:
    from megatron_gnmr.interop.hf import judge

    row = torch.tensor([context + choice])
    log_probs = torch.log_softmax(judge.logits(model, row)[0, :-1].double(), dim=-1)
    targets = row[0, 1:]
    picked = log_probs[torch.arange(len(targets)), targets]
    return float(picked[len(context) - 1:].sum())


def test_native_samples_are_transformers_scores(exported):
    from megatron_gnmr.evaluation.command import held_out_items
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.training import distributed

    run = exported / "run"
    flags = dict(ppl_sequences=8, cloze_items=8, heldout_seed=0, context_tokens=16,
                 continuation_tokens=8)
    assert cli("evaluate", str(run), "--exact", "--tasks", "ppl,cloze", "--log-samples",
               *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]) == 0
    results = json.loads((run / "evaluation-exact.json").read_text())
    records = _read_jsonl(run / "evaluation-exact_samples.jsonl")
    ppl = [r for r in records if r["task"] == "ppl"]
    cloze = [r for r in records if r["task"] == "cloze"]
    assert len(ppl) == 8 and len(cloze) == 8 and len(records) == 16

    loaded = load_run(str(run), exact=True)
    try:
        valid = loaded.valid_split(sequences=8, seed=0)
        samples = [valid[i] for i in range(8)]
        items = held_out_items(valid, Namespace(**flags))
    finally:
        distributed.shutdown()
    model = judge.load(exported / "hf")
    for number, (record, sample) in enumerate(zip(ppl, samples)):
        assert (record["doc_id"], record["view"]) == (number, "run")
        assert record["tokens"] == int(torch.as_tensor(sample["loss_mask"]).sum())
        assert record["loss"] == pytest.approx(judge.mean_loss(model, [sample]), rel=1e-5)
        assert record["ppl"] == pytest.approx(math.exp(record["loss"]))
    for record, item in zip(cloze, items):
        assert record["answer"] == item.answer
        theirs = [_choice_log_likelihood(model, list(item.context), list(choice))
                  for choice in item.choices]
        assert record["log_likelihoods"] == pytest.approx(theirs, abs=1e-4)
        normalised = [ll / n for ll, n in zip(theirs, record["characters"])]
        assert record["picked"] == max(range(4), key=normalised.__getitem__)
        assert record["correct"] == (record["picked"] == item.answer)
    assert sum(r["correct"] for r in cloze) / 8 == pytest.approx(results["cloze_accuracy"])
