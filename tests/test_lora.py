"""LoRA under INT8 (issue 21): the adapters, the W8A8 base path, merging, the cloze scorer and
the Austen reader against references; a fine-tune in this process (base frozen, adapters
only in its checkpoints, resumed bit for bit, merged weights equal to base + adapters)."""

import hashlib
import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller.units import UnitShape, local_unit_modules
from megatron_gnmr.errors import UserError
from megatron_gnmr.evaluation.tasks import ClozeItem, choice_score, cloze_accuracy, cloze_items
from megatron_gnmr.lora.adapters import check_dim, freeze_base, is_target
from megatron_gnmr.lora.merge import merge_group
from megatron_gnmr.model import add_lora, bind_precision, build_gpt_model, transformer_config
from megatron_gnmr.precision.paths import emulated_linear
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.recipes import w8a8
from tests.helpers import TINY, pretrain_in_process, read_jsonl, train_losses


def _logits(recipe: str, lora: bool, extra=()):
    from megatron_gnmr.training.distributed import set_seeds

    config = parse_config([*TINY, "--precision-recipe", recipe, *extra])
    set_seeds(7)
    tconfig = transformer_config(config)
    model = build_gpt_model(config, tconfig, vocab_size=512)
    if lora:
        config.lora.enabled = True
        add_lora(model, config, tconfig)
    units = local_unit_modules([model], UnitShape.of(config))
    bind_precision(units, config, PrecisionPlan())
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens, torch.arange(64).expand(2, 64), None), model


@pytest.mark.parametrize("recipe", ["none", "w8a8"])
def test_adapters_at_init_leave_the_outputs_bitwise_unchanged(megatron_world, recipe):
    plain, _ = _logits(recipe, lora=False)
    adapted, model = _logits(recipe, lora=True)
    assert torch.equal(plain, adapted)
    adapters = [m for m in model.modules() if hasattr(m, "linear_in")]
    assert len(adapters) == 8  # 2 layers x qkv, proj, fc1, fc2
    assert all(torch.count_nonzero(a.linear_out.weight) == 0 for a in adapters)  # B = 0
    assert all(torch.count_nonzero(a.linear_in.weight) > 0 for a in adapters)  # A drawn


def test_only_adapters_train_and_they_are_the_units_parameters(megatron_world):
    _, model = _logits("w8a8", lora=True, extra=["--lora-target-modules", "linear_qkv",
                                                  "*.layers.1.*.linear_fc2"])
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"decoder.layers.{layer}.{suffix}.adapter.{side}.weight"
        for layer, suffix in ((0, "self_attention.linear_qkv"), (1, "self_attention.linear_qkv"),
                              (1, "mlp.linear_fc2"))
        for side in ("linear_in", "linear_out"))
    freeze_base(model)  # idempotent
    assert is_target("layers.1.mlp.linear_fc2", ["*.layers.1.*.linear_fc2"])
    assert not is_target("layers.0.mlp.linear_fc2", ["*.layers.1.*.linear_fc2"])
    with pytest.raises(UserError, match="--lora-dim 6 must be divisible"):
        check_dim(parse_config(["--lora-dim", "6"]).lora, 4)


# -- W8A8 against float64 ----------------------------------------------------------------
def _int_rows_reference(x: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric integers per row, in numpy: scale = (2^(b-1) - 1) / max|row| (float32, as
    TE computes it), round half to even, clip, times the float32 reciprocal of the scale."""
    top = 2 ** (bits - 1) - 1
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    return np.clip(np.round(x * scale), -top - 1, top) * np.reciprocal(scale)


@pytest.mark.parametrize("bits", [8, 4])
def test_w8a8_matches_a_float64_reference_and_skips_the_frozen_weights_gradient(bits):
    from megatron_gnmr.precision.scaling import quantize

    path = w8a8(parse_config(["--int-weight-bits", str(bits), "--int-activation-bits",
                              str(bits)]).precision).low
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=generator) * torch.logspace(-2, 1, 96)).requires_grad_()
    weight = torch.randn(40, 96, generator=generator) * 0.05  # frozen: no requires_grad
    x_q = _int_rows_reference(x.detach().reshape(-1, 96).numpy(), bits).astype(np.float64)
    w_q = _int_rows_reference(weight.numpy(), bits).astype(np.float64)
    np.testing.assert_array_equal(quantize(x.detach(), path.input).reshape(-1, 96).numpy(), x_q)
    np.testing.assert_array_equal(quantize(weight, path.weight).numpy(), w_q)
    levels = np.unique(np.round(x_q[0] / np.abs(x_q[0]).max() * (2 ** (bits - 1) - 1)))
    assert len(levels) > min(20, 2 ** bits // 2)  # the rows span the grid
    out = emulated_linear(x, weight, None, path, False, None)
    np.testing.assert_allclose(out.detach().reshape(-1, 40).double().numpy(), x_q @ w_q.T,
                               rtol=1e-5, atol=1e-6)
    grad = torch.randn(3, 5, 40, generator=generator)
    out.backward(grad)
    np.testing.assert_allclose(x.grad.reshape(-1, 96).double().numpy(),
                               grad.reshape(-1, 40).double().numpy() @ w_q, rtol=1e-5,
                               atol=1e-6)
    assert weight.grad is None
    trainable = weight.clone().requires_grad_()
    emulated_linear(x.detach(), trainable, None, path, False, None).backward(grad)
    np.testing.assert_allclose(trainable.grad.double().numpy(),
                               grad.reshape(-1, 40).double().numpy().T @ x_q, rtol=1e-5,
                               atol=1e-5)


# -- merging, shard by shard -------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("linear", ["linear_qkv", "linear_fc2"])
def test_merging_tp_shards_equals_the_float64_merge_of_the_whole_matrices(tp, linear):
    """Shards laid out as Megatron-Bridge's adapters (column base: A split along r, B along
    N; row base: A along K, B along N), merged per TP group, put back together."""
    rng = np.random.default_rng(1)
    n, k, r, scale = 12, 8, 4, 2.0
    w, a, b = rng.standard_normal((n, k)), rng.standard_normal((r, k)), rng.standard_normal((n, r))
    row = linear == "linear_fc2"
    key = f"decoder.layers.0.mlp.{linear}"
    bases, adapters = [], []
    for rank in range(tp):
        w_part = np.split(w, tp, axis=1 if row else 0)[rank]
        a_part = np.split(a, tp, axis=1 if row else 0)[rank]
        b_part = np.split(b, tp, axis=0)[rank]
        bases.append({f"{key}.weight": torch.tensor(w_part, dtype=torch.float32)})
        adapters.append({f"{key}.adapter.linear_in.weight": torch.tensor(a_part),
                         f"{key}.adapter.linear_out.weight": torch.tensor(b_part)})
    merged = merge_group(bases, adapters, scale, {"linear_proj", "linear_fc2"})
    whole = np.concatenate([m[f"{key}.weight"].double().numpy() for m in merged],
                           axis=1 if row else 0)
    np.testing.assert_allclose(whole, w.astype(np.float32) + scale * b @ a, rtol=1e-6,
                               atol=1e-6)
    assert all(set(m) == {f"{key}.weight"} for m in merged)


# -- the cloze task --------------------------------------------------------------------
def test_the_cloze_scorer_on_a_hand_computed_example():
    """Two items. Item 1: the true choice (index 2) has log-probs summing to -6 over 6
    characters (-1 per character); a distractor sums to -4 over 2 characters (-2): the raw
    sum would pick the distractor, length normalisation picks the truth. Item 2: the answer
    (index 0) loses to choice 3 either way. Accuracy 1/2."""
    items = [ClozeItem((1,), ((7,), (8,), (9,), (10,)), 2),
             ClozeItem((2,), ((11,), (12,), (13,), (14,)), 0)]
    log_probs = {7: [-4.0], 8: [-9.0], 9: [-3.0, -3.0], 10: [-20.0],
                 11: [-5.0], 12: [-9.0], 13: [-9.0], 14: [-1.0]}
    characters = {7: 2, 8: 3, 9: 6, 10: 4, 11: 5, 12: 5, 13: 5, 14: 5}
    assert choice_score(log_probs[9], characters[9]) == -1.0
    result = cloze_accuracy(items, lambda contexts, choices: [np.array(log_probs[c[0]])
                                                             for c in choices],
                            lambda choice: characters[choice[0]])
    assert result["accuracy"] == 0.5 and result["items"] == 2
    assert result["stderr"] == pytest.approx(np.std([1, 0], ddof=1) / np.sqrt(2))


def test_cloze_items_are_true_continuations_against_other_documents():
    documents = [list(range(1000 * d, 1000 * d + 100 + 7 * d)) for d in range(6)]
    items = cloze_items(documents, context=10, continuation=5, count=50, seed=3)
    assert len(items) == len({(i.context, i.choices[i.answer]) for i in items})
    for item in items:
        document = item.context[0] // 1000
        assert item.choices[item.answer] == tuple(range(item.context[-1] + 1,
                                                        item.context[-1] + 6))
        assert all(choice[0] // 1000 != document for n, choice in enumerate(item.choices)
                   if n != item.answer)
    assert len({item.answer for item in items}) == 4  # every position is used
    with pytest.raises(UserError, match="need at least 4"):
        cloze_items(documents[:3], 10, 5, 10)


# -- the Austen corpus reader ------------------------------------------------------------
def _xdr_character_vector(lines: list) -> bytes:
    body = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    body += struct.pack(">ii", 16, len(lines))
    for line in lines:
        if line is None:
            body += struct.pack(">ii", 9, -1)
        else:
            raw = line.encode()
            body += struct.pack(">ii", 0x00040009, len(raw)) + raw
    return body


def _deb_with(rdb: bytes) -> bytes:
    from megatron_gnmr.data.austen import RDATA

    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        info = tarfile.TarInfo("./" + RDATA)
        info.size = len(rdb)
        tar.addfile(info, io.BytesIO(rdb))
    archive = b"!<arch>\n"
    for name, body in ((b"debian-binary", b"2.0\n"), (b"data.tar.xz", tar_bytes.getvalue())):
        archive += name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + \
            b"100644".ljust(8) + str(len(body)).encode().ljust(10) + b"`\n" + body
        archive += b"\n" if len(body) % 2 else b""
    return archive


def test_the_austen_reader_reads_r_character_vectors_out_of_a_deb():
    from megatron_gnmr.data.austen import character_vectors, rdata_from_deb

    novels = [["EMMA", "", "By Jane Austen", "Ümlaut and — dash"], ["PERSUASION", None, "x"]]
    rdb = b""
    for novel in novels:
        serialised = _xdr_character_vector(novel)
        rdb += struct.pack(">i", len(serialised)) + zlib.compress(serialised)
    assert character_vectors(rdata_from_deb(_deb_with(rdb))) == \
        [["EMMA", "", "By Jane Austen", "Ümlaut and — dash"], ["PERSUASION", "", "x"]]
    with pytest.raises(UserError, match="not a Debian archive"):
        rdata_from_deb(b"PK\x03\x04")


# -- a fine-tune in this process -------------------------------------------------------
FINETUNE = [*TINY, "--train-iters", "6", "--lr-warmup-iters", "1", "--eval-interval", "100",
            "--finetune", "--lora", "--lora-dim", "8", "--lora-alpha", "16",
            "--precision-recipe", "w8a8", "--gnmr", "--gnmr-delta", "1", "--gnmr-warmup", "2",
            "--gnmr-alpha", "1.05", "--gnmr-beta", "1.05", "--gnmr-max-o", "2"]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    assert pretrain_in_process([*TINY, "--train-iters", "4", "--eval-interval", "4",
                                "--save", str(root / "base")]) == 0
    for name, extra in (("straight", []), ("stopped", ["--exit-interval", "3"]),
                        ("stopped", ["--resume", "auto"])):
        assert pretrain_in_process([*FINETUNE, "--load", str(root / "base"), *extra,
                                    "--save", str(root / name)]) == 0
    return root


def test_a_finetune_checkpoint_holds_the_adapters_and_names_its_base(finetuned):
    base_iter = finetuned / "base" / "iter_0000004"  # the base: torch_dist, the default
    iteration = finetuned / "straight" / "checkpoints" / "iter_0000006"
    meta = json.loads((iteration / "meta.json").read_text())
    assert meta["lora"]["base"] == {  # the base's manifest records every file's sha256
        "path": str(base_iter.resolve()),
        "sha256": hashlib.sha256((base_iter / "megatron_gnmr.json").read_bytes()).hexdigest()}
    shard = torch.load(iteration / "rank_00000.pt", weights_only=True)
    keys = list(shard["model"][0])
    assert len(keys) == 16 and all(".adapter.linear_" in k for k in keys)
    records = read_jsonl(finetuned / "straight" / "gnmr_trace.jsonl")
    assert any(r.get("recovery") for r in records)  # the controller chose adapted units


def test_a_resumed_finetune_equals_the_uninterrupted_one(finetuned):
    straight, stopped = train_losses(finetuned / "straight"), train_losses(finetuned / "stopped")
    assert sorted(stopped) == list(range(1, 7)) and stopped == straight


def test_a_finetune_over_another_base_is_refused(finetuned, tmp_path, capfd):
    other = tmp_path / "other_base"
    assert pretrain_in_process([*TINY, "--train-iters", "4", "--eval-interval", "4",
                                "--seed", "5", "--save", str(other)]) == 0
    code = pretrain_in_process([*FINETUNE, "--load", str(other), "--resume", "auto",
                                "--save", str(finetuned / "stopped")])
    assert code == 2
    assert "base checkpoint (--finetune --load) sha256" in capfd.readouterr().err
    code = pretrain_in_process([*FINETUNE, "--load", str(finetuned / "straight"),
                                "--save", str(tmp_path / "on_adapters")])
    assert code == 2 and "merge-lora" in capfd.readouterr().err


def test_only_the_adapters_change_during_a_finetune(tmp_path):
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer

    config = parse_config([*TINY, "--train-iters", "3", "--lora", "--precision-recipe", "w8a8"])
    distributed.initialize(config)
    try:
        trainer = Trainer(config)
        before = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}
        for step in range(3):
            trainer.train_step(step)
        after = dict(trainer.model[0].named_parameters())
        optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    for name, value in before.items():
        adapter = ".adapter." in name
        assert torch.equal(after[name], value) != adapter, name
        assert (id(after[name]) in optimized) == adapter, name


def test_merged_weights_give_the_logits_of_base_plus_adapters(finetuned):
    """Tolerance: 1e-4 absolute on logits of order 10 (W + s B A is rounded to float32 once,
    where base + adapters rounds the two GEMMs' outputs apart)."""
    from megatron.core import parallel_state

    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.training.merge_lora import merge_run

    merge_run(str(finetuned / "straight"), str(finetuned / "merged"))
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(64).expand(2, 64)
    try:
        logits = {}
        for name in ("straight", "merged"):
            run = load_run(str(finetuned / name), exact=True)
            with torch.no_grad():
                logits[name] = run.model[0](tokens, positions, None)
        from megatron_gnmr.lora.adapters import adapters_disabled

        run = load_run(str(finetuned / "straight"), exact=True)
        with torch.no_grad(), adapters_disabled(run.model):
            base = run.model[0](tokens, positions, None)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    assert (logits["straight"] - base).abs().max() > 1e-3  # the adapters did something
    torch.testing.assert_close(logits["merged"], logits["straight"], rtol=0, atol=1e-4)


def test_evaluate_agrees_with_the_runs_own_validation(finetuned):
    """`evaluate`'s perplexity over the first 16 held-out sequences, in the run's own order
    (its seed), is the trainer's validation loss (eval-iters 2 x global batch 8)."""
    from argparse import Namespace

    from megatron_gnmr.evaluation import command

    args = Namespace(run_dir=str(finetuned / "base"), tasks="ppl,cloze", ppl_sequences=16,
                     cloze_items=40, context_tokens=48, continuation_tokens=16, exact=False,
                     heldout_seed=parse_config(TINY).training.seed)
    results = command.run(args)
    summary = json.loads((finetuned / "base" / "summary.json").read_text())
    assert results["loss"] == pytest.approx(summary["final_valid_loss"], rel=1e-6)
    assert 0.0 <= results["cloze_accuracy"] <= 1.0 and results["cloze_items"] == 40
    assert json.loads((finetuned / "base" / "evaluation.json").read_text())["ppl"] == \
        pytest.approx(np.exp(results["loss"]))
    from megatron_gnmr.observe.report import evaluation_line, load_run

    line = evaluation_line(load_run(str(finetuned / "base")))
    assert f"held-out ppl {np.exp(results['loss']):.1f}" in line and "cloze" in line


def test_a_full_finetune_starts_from_the_bases_weights_at_step_zero(finetuned, tmp_path):
    """Without --lora, --finetune reads every weight and nothing else: the first validation
    (same corpus) is the base's last, and the run counts its own steps from 0."""
    assert pretrain_in_process([*TINY, "--train-iters", "2", "--lr-warmup-iters", "1",
                                "--eval-interval", "2", "--finetune", "--load", str(finetuned / "base"),
                                "--save", str(tmp_path / "full")]) == 0
    base = json.loads((finetuned / "base" / "summary.json").read_text())
    tuned = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert tuned["initial_valid_loss"] == pytest.approx(base["final_valid_loss"], rel=1e-12)
    assert sorted(train_losses(tmp_path / "full")) == [1, 2]


def test_merge_lora_refuses_an_out_directory_that_holds_anything(finetuned, tmp_path):
    from megatron_gnmr.training.merge_lora import merge_run

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--out .* is not empty"):
        merge_run(str(finetuned / "straight"), str(busy))
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]  # nothing written beside
    with pytest.raises(UserError, match="is a file"):
        merge_run(str(finetuned / "straight"), str(busy / "notes.txt"))


def test_evaluate_refuses_a_config_that_does_not_match_its_checkpoint(finetuned, tmp_path):
    """A run directory whose config.json was edited: one line naming the field, not a
    tensor-size traceback from torch."""
    import shutil

    from megatron.core import parallel_state

    from megatron_gnmr.evaluation.loaded_run import load_run

    run = tmp_path / "edited"
    shutil.copytree(finetuned / "base", run)
    config = json.loads((run / "config.json").read_text())
    config["model"]["ffn_hidden_size"] = 192
    (run / "config.json").write_text(json.dumps(config))
    try:
        with pytest.raises(UserError, match="--ffn-hidden-size 192, its checkpoint was "
                                            "written with 176"):
            load_run(str(run))
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
