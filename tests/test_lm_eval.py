"""`evaluate --lm-eval`: lm-eval-harness over our own forward, judged by lm-eval itself on the
same model exported and read by transformers (its HFLM): the shipped local tasks (a
multiple-choice cloze, rolling-window perplexity) give the same metrics, every choice's
log-likelihood agrees within 1e-4 and its greedy flag is the same; the comparison fails when
our scores are read one position off; bad input is one line. The same with a Hugging Face BPE
tokenizer whose BOS is not its EOS (nothing adds it, or its template does, as Llama's): each
document's rolling log-likelihood within 1e-4, bits per byte within 1e-5."""

import json

import pytest
import torch

from tests.hf_bpe_tokenizer import BOS, bpe_tokenizer_with_bos, corpus_in
from tests.helpers import TINY, pretrain_in_process
from tests.test_hf_interop import cli

pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (pip install -e .[dev])")
pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

TASKS = ["shakespeare_cloze", "shakespeare_passages"]
LIMIT = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    assert pretrain_in_process([*TINY, "--train-iters", "20", "--eval-interval", "100",
                                "--save", str(root / "run")]) == 0
    assert cli("export-hf", str(root / "run"), str(root / "hf"), "--dtype", "fp32") == 0
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["bos_unused", "bos_in_template"])
def exported_with_bos(request, tmp_path_factory):
    """A run trained on text in a BPE tokenizer whose BOS (1) is not its EOS (2), exported."""
    root = tmp_path_factory.mktemp("lm_eval_bos")
    tokenizer = bpe_tokenizer_with_bos(root / "tokenizer", template=request.param)
    prefix = corpus_in(tokenizer, root / "data")
    assert pretrain_in_process([*TINY, "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", str(tokenizer), "--data-path", prefix,
                                "--train-iters", "20", "--eval-interval", "100",
                                "--save", str(root / "run")]) == 0
    assert cli("export-hf", str(root / "run"), str(root / "hf"), "--dtype", "fp32") == 0
    return root


@pytest.fixture(scope="module")
def judged(exported):
    """lm-eval's own numbers on the export, through transformers (computed once: they are the
    judge of every test on `exported`)."""
    return _through_transformers(exported)


def _through_transformers(exported):
    from megatron_gnmr.evaluation import lm_eval_run

    hf = ("hf", {"pretrained": str(exported / "hf"), "dtype": "float32", "device": "cpu",
                 "batch_size": 4})
    return lm_eval_run.evaluate_with_lm_eval(hf, TASKS, lm_eval_run.check_tasks(TASKS, []),
                                             LIMIT, samples=True)


def _ours(exported):
    from megatron_gnmr.evaluation import lm_eval_run
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.training import distributed

    run = load_run(str(exported / "run"), exact=True)
    try:
        return lm_eval_run.evaluate_with_lm_eval(run, TASKS, lm_eval_run.check_tasks(TASKS, []),
                                                 LIMIT, samples=True)
    finally:
        distributed.shutdown()


def _choice_scores(result) -> list[tuple[float, bool]]:
    return [(float(score), bool(greedy)) for sample in result["samples"]["shakespeare_cloze"]
            for (score, greedy), in sample["resps"]]


def test_lm_eval_on_our_forward_equals_lm_eval_through_transformers(exported, judged):
    theirs = judged
    assert cli("evaluate", str(exported / "run"), "--exact", "--lm-eval", ",".join(TASKS),
               "--lm-eval-limit", str(LIMIT)) == 0
    ours = json.loads((exported / "run" / "lm_eval-exact.json").read_text())
    cloze, theirs_cloze = ours["results"]["shakespeare_cloze"], \
        theirs["results"]["shakespeare_cloze"]
    assert (cloze["acc,none"], cloze["acc_norm,none"]) == \
        (theirs_cloze["acc,none"], theirs_cloze["acc_norm,none"])
    passages, theirs_passages = ours["results"]["shakespeare_passages"], \
        theirs["results"]["shakespeare_passages"]
    for metric in ("bits_per_byte,none", "byte_perplexity,none", "word_perplexity,none"):
        assert passages[metric] == pytest.approx(theirs_passages[metric], rel=1e-5), metric
    assert ours["n-samples"]["shakespeare_cloze"]["effective"] == LIMIT
    # every choice of every item, not only the argmax: the same log-likelihood and greedy flag
    mine = _choice_scores(_ours(exported))
    judge = _choice_scores(theirs)
    assert len(mine) == len(judge) == 4 * LIMIT
    gap = max(abs(a - b) for (a, _), (b, _) in zip(mine, judge))
    print(f"\nlm-eval cloze: max |ours - transformers| over {len(mine)} choices = {gap:.1e} "
          f"(log-likelihoods {min(s for s, _ in judge):.1f} to {max(s for s, _ in judge):.1f})")
    assert gap <= 1e-4
    assert [g for _, g in mine] == [g for _, g in judge]


def _document_log_likelihoods(result) -> list[float]:
    return [float(sample["resps"][0][0]) for sample in result["samples"]["shakespeare_passages"]]


def test_a_tokenizer_with_a_bos_gives_lm_eval_numbers_on_the_export(exported_with_bos):
    """lm-eval's HFLM conditions a document's first token on the tokenizer's BOS and encodes
    with the tokenizer's template: our forward must do the same, and the export must say
    which id is BOS."""
    hf_dir = exported_with_bos / "hf"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((hf_dir / name).read_text())["bos_token_id"] == BOS, name
    theirs, ours = _through_transformers(exported_with_bos), _ours(exported_with_bos)
    mine, judge = _document_log_likelihoods(ours), _document_log_likelihoods(theirs)
    assert len(mine) == len(judge) == LIMIT
    gap = max(abs(a - b) for a, b in zip(mine, judge))
    bits = [result["results"]["shakespeare_passages"]["bits_per_byte,none"]
            for result in (ours, theirs)]
    choices = [_choice_scores(result) for result in (ours, theirs)]
    choice_gap = max(abs(a - b) for (a, _), (b, _) in zip(*choices))
    print(f"\nBPE with BOS: max |ours - lm-eval| per document {gap:.1e} (log-likelihoods "
          f"{min(judge):.1f} to {max(judge):.1f}), per choice {choice_gap:.1e}; bits per byte "
          f"{bits[0]:.7f} against {bits[1]:.7f}")
    assert gap <= 1e-4
    assert abs(bits[0] - bits[1]) <= 1e-5
    assert choice_gap <= 1e-4 and [g for _, g in choices[0]] == [g for _, g in choices[1]]


def test_scores_read_one_position_off_break_the_agreement(exported, judged, monkeypatch):
    """The check can fail: each position's logits replaced by the previous position's."""
    from megatron_gnmr.evaluation.loaded_run import LoadedRun

    logits = LoadedRun.logits
    monkeypatch.setattr(LoadedRun, "logits",
                        lambda self, tokens: torch.roll(logits(self, tokens), 1, dims=1))
    gap = max(abs(a - b) for (a, _), (b, _) in
              zip(_choice_scores(_ours(exported)), _choice_scores(judged)))
    assert gap > 100 * 1e-4, gap  # a 20-step model depends little on position: 0.17 here


@pytest.mark.parametrize("flags,named", [
    (["--lm-eval", "no_such_task"], "lm-eval knows no task no_such_task"),
    (["--lm-eval", "shakespeare_cloze", "--lm-eval-include", "/no/such/dir"],
     "--lm-eval-include /no/such/dir: no such directory"),
    (["--lm-eval", "shakespeare_cloze", "--lm-eval-limit", "0"], "--lm-eval-limit must be >= 1"),
    (["--lm-eval", "generates"], "generate_until"),
], ids=["unknown_task", "missing_include", "zero_limit", "generation_task"])
def test_bad_lm_eval_input_is_one_line(exported, tmp_path, capfd, flags, named):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "generates.yaml").write_text(
        "task: generates\ndataset_path: json\ncustom_dataset: !function loader.load\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{text}}\"\n"
        "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: exact_match\n")
    (tasks / "loader.py").write_text(
        "def load(**_):\n    import datasets\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list("
        "[{'text': 'To be'}])})\n")
    include = [] if "--lm-eval-include" in flags else ["--lm-eval-include", str(tasks)]
    capfd.readouterr()
    assert cli("evaluate", str(exported / "run"), *flags, *include) != 0
    err = capfd.readouterr().err
    assert named in err and "Traceback" not in err, err
    assert not (exported / "run" / "lm_eval.json").exists()
