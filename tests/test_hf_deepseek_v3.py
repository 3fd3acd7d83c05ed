"""DeepSeek-V3 in and out of the deepseek-mla family (`model_families/deepseek_mla_hf.py`),
judged by transformers' own DeepseekV3ForCausalLM on the CPU with the bound of
tests/test_hf_interop.py (max |ours - transformers| <= 1e-5 x max |transformers' logit|,
float32). The random model has V3's parts at a small width: a query latent, MLA's content and
RoPE head parts, YaRN (factor 40, V3's bands), a dense first layer, 8 routed experts in 4
groups (top 4 from the best 2 groups, V3's topk / group_topk = 2), a shared expert, sigmoid
routing with a random e_score_correction_bias and the routed scaling factor 2.5. Its logits,
the defects that break them and the round trip: tests/test_hf_families.py. Measured on this AMD EPYC: 3.2e-6 imported (transformers' own float32 is 2.9e-6 from its
float64). transformers' latent norms always use eps 1e-6 (so does V3): another rms_norm_eps
gave 9e-6, and is refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, pretrain_in_process
from tests.test_hf_interop import BOUND, HF_TOKENIZER, cli, relative_gap, tokens

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 16}


def random_deepseek_v3(directory: Path, seed: int = 0, **overrides) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=640, hidden_size=64, intermediate_size=128,
                    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
                    topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
                    norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
                    initializer_range=0.2, tie_word_embeddings=False, rope_parameters=YARN)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**settings, **overrides})).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(str(directory), safe_serialization=True)
    for file in HF_TOKENIZER.iterdir():
        shutil.copyfile(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    hf = random_deepseek_v3(root / "hf")
    assert cli("import-hf", str(hf), str(root / "ours")) == 0
    return root


def _gap(run: Path, hf: Path) -> float:
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    ids = tokens(600)
    return relative_gap(logits_of(run, ids), judge.logits(judge.load(hf), ids))


def test_an_imported_deepseek_v3_reads_its_latents_yarn_and_groups(imported):
    """The logits, the defects that break them (YaRN or the routing bias dropped) and the
    round trip of the tensors: tests/test_hf_families.py."""
    settings = json.loads((imported / "ours" / "config.json").read_text())
    assert settings["model"]["model_family"] == "deepseek-mla"
    assert settings["mla"]["rotary_scaling_factor"] == 40.0 and settings["mla"]["q_lora_rank"] \
        == 48
    assert settings["model"]["moe_router_num_groups"] == 4 and \
        settings["model"]["moe_router_topk_scaling_factor"] == 2.5


def test_yarn_exports_as_imported(imported, tmp_path):
    assert cli("export-hf", str(imported / "ours"), str(tmp_path / "back"), "--dtype",
               "fp32") == 0
    ours = json.loads((tmp_path / "back" / "config.json").read_text())
    for key, value in YARN.items():
        assert ours["rope_parameters"][key] == value, key


DEEPSEEK_RUN = ["--config", str(REPO / "configs" / "deepseek_tiny_cpu.yaml"),
                "--expert-model-parallel-size", "1", "--precision-recipe", "none",
                "--no-moe-dispatch-quant",
                "--no-gnmr", "--q-lora-rank", "32",
                "--norm-epsilon", "1e-6", "--moe-router-topk-scaling-factor", "2.5",
                "--train-iters", "3", "--lr-warmup-iters", "1", "--eval-interval", "100",
                "--log-interval", "1",
                "--data-cache-dir", str(REPO / ".cache" / "megatron_gnmr")]


def test_a_deepseek_run_exported_loads_as_deepseek_v3_with_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    run = tmp_path / "run"
    assert pretrain_in_process([*DEEPSEEK_RUN, "--save", str(run)]) == 0
    assert cli("export-hf", str(run), str(tmp_path / "hf"), "--dtype", "fp32") == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))  # no extra code
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    ids = tokens(4096)
    gap = relative_gap(logits_of(run, ids), judge.logits(model.float(), ids))
    print(f"\nexported deepseek-mla run: max |ours - transformers| / max |logit| = {gap:.2e}")
    assert gap <= BOUND


@pytest.mark.parametrize("change,named", [
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"rope_interleave": False}, "rope_interleave false"),
    ({"num_experts_per_tok": 2}, "num_experts_per_tok 2 / topk_group 2"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}},
     "rope type 'dynamic'"),
], ids=["latent_norm_eps", "not_interleaved", "group_rank", "dynamic_rope"])
def test_a_deepseek_v3_we_cannot_build_is_refused_by_name(imported, tmp_path, capfd, change,
                                                          named):
    bad = tmp_path / "hf"
    shutil.copytree(imported / "hf", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    capfd.readouterr()
    assert cli("import-hf", str(bad), str(tmp_path / "ours")) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and named in error[0], error
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("flags,named", [
    (["--moe-router-score-function", "softmax", "--no-moe-router-enable-expert-bias"],
     "--moe-router-score-function softmax"),
    (["--norm-epsilon", "1e-5"], "--norm-epsilon 1e-05"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--moe-router-topk 2 / --moe-router-group-topk 2"),
], ids=["softmax_router", "norm_eps", "group_rank"])
def test_a_run_deepseek_v3_cannot_express_is_refused_by_name(flags, named):
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.errors import UserError
    from megatron_gnmr.model_families import hf_mapping

    config = parse_config([*DEEPSEEK_RUN, *flags])
    with pytest.raises(UserError, match=named.replace("-", r"\-").replace(".", r"\.")):
        hf_mapping(config, "export-hf RUN")
