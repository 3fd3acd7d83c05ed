"""One recipe for every Hugging Face class import-hf reads, judged by transformers' own class on
the CPU with the bound of tests/test_hf_interop.py (max |ours - transformers| <= 1e-5 x max
|transformers' logit|, float32):

- a random model of the class imported gives transformers' logits;
- a defect the importer cannot see breaks the bound: two layers' attentions exchanged, for
  every class, and each family's own (RoPE pairs permuted, experts in each other's slots,
  YaRN or the routing bias dropped), so the check can fail;
- export of the import is the original bit for bit, tensors and the config fields it read.

A class the importer reads without a random model here fails
`test_every_class_import_hf_reads_has_a_random_model`: a new family adds its random model (and
its own defects) to the tables below and gets the recipe."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_hf_deepseek_v3 import YARN, random_deepseek_v3
from tests.test_hf_interop import BOUND, cli, random_llama, relative_gap, tokens
from tests.test_hf_llama3 import _random_mistral
from tests.test_hf_mixtral import random_mixtral

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")

RANDOM_MODELS = {"LlamaForCausalLM": random_llama, "MistralForCausalLM": _random_mistral,
                 "MixtralForCausalLM": random_mixtral,
                 "DeepseekV3ForCausalLM": random_deepseek_v3}
# tensors on disk, counted by hand: 3 outside the layers (embedding, final norm, head), then
# per layer 4 attention projections and 2 norms + the MLP's 3 (Llama, Mistral); + the router
# and 3 per expert of 4 (Mixtral); DeepSeek-V3's layers: 7 MLA weights and 2 norms, the dense
# first layer's 3 MLP weights, each MoE layer's router, bias, 8 x 3 routed and 3 shared
TENSORS = {"LlamaForCausalLM": 3 + 2 * 9, "MistralForCausalLM": 3 + 2 * 9,
           "MixtralForCausalLM": 3 + 2 * (7 + 3 * 4),
           "DeepseekV3ForCausalLM": 3 + 3 * 9 + 3 + 2 * (2 + 8 * 3 + 3)}
# what the export writes: a Mistral without a sliding window (the only one imported) is a Llama
EXPORTED_AS = {"MistralForCausalLM": "LlamaForCausalLM"}
COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "rms_norm_eps", "tie_word_embeddings")
CONFIG_FIELDS = {  # what each class's export must give back as imported
    "LlamaForCausalLM": ("num_key_value_heads", "max_position_embeddings"),
    "MistralForCausalLM": ("num_key_value_heads", "head_dim"),
    "MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok", "num_key_value_heads",
                           "sliding_window"),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                              "n_group", "topk_group", "routed_scaling_factor",
                              "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
                              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                              "moe_intermediate_size")}


def _edit_weights(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(directory / "model.safetensors"))
    edit(weights)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _attentions_exchanged(directory: Path) -> None:
    """Layers 0 and 1 given each other's attention weights (a converter numbering layers
    wrongly): every shape still fits."""
    def edit(weights):
        for name in [n for n in weights if n.startswith("model.layers.0.self_attn.")]:
            other = name.replace("model.layers.0.", "model.layers.1.")
            weights[name], weights[other] = weights[other], weights[name]
    _edit_weights(directory, edit)


def _rope_pairs_permuted(directory: Path, head_dim: int = 16) -> None:
    """q and k rows permuted from halves to interleaved pairs (what a converter that assumes
    the other RoPE convention writes)."""
    order = torch.arange(head_dim).reshape(2, head_dim // 2).t().reshape(-1)  # 0, 8, 1, 9, ...

    def edit(weights):
        for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight"))]:
            heads = weights[name].reshape(-1, head_dim, weights[name].shape[1])
            weights[name] = heads[:, order].reshape(weights[name].shape).contiguous()
    _edit_weights(directory, edit)


def _experts_exchanged(directory: Path) -> None:
    """Layer 0's experts 0 and 1 in each other's slots, the router unchanged (each token then
    goes to another expert's weights)."""
    def edit(weights):
        prefix = "model.layers.0.block_sparse_moe.experts."
        for w in ("w1", "w2", "w3"):
            first, second = f"{prefix}0.{w}.weight", f"{prefix}1.{w}.weight"
            weights[first], weights[second] = weights[second], weights[first]
    _edit_weights(directory, edit)


def _yarn_dropped(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": YARN["rope_theta"], "rope_type": "default"}
    (directory / "config.json").write_text(json.dumps(config))


def _expert_bias_dropped(directory: Path) -> None:
    def edit(weights):
        for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
            weights[name] = torch.zeros_like(weights[name])
    _edit_weights(directory, edit)


DEFECTS = {
    "LlamaForCausalLM": {"rope_pairs_permuted": _rope_pairs_permuted},
    "MistralForCausalLM": {"rope_pairs_permuted": _rope_pairs_permuted},
    "MixtralForCausalLM": {"experts_exchanged": _experts_exchanged},
    "DeepseekV3ForCausalLM": {"yarn_dropped": _yarn_dropped,
                              "expert_bias_dropped": _expert_bias_dropped},
}
CASES = [(cls, name, defect) for cls in RANDOM_MODELS
         for name, defect in {"attentions_exchanged": _attentions_exchanged,
                              **DEFECTS[cls]}.items()]


def test_every_class_import_hf_reads_has_a_random_model():
    from megatron_gnmr.model_families import FAMILIES

    read = {cls for family in FAMILIES.values() if getattr(family, "hf", None)
            for cls in family.hf.architectures}
    assert read == set(RANDOM_MODELS) == set(TENSORS) == set(CONFIG_FIELDS) == set(DEFECTS)


@pytest.fixture(scope="module", params=sorted(RANDOM_MODELS))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = RANDOM_MODELS[request.param](root / "hf")
    assert cli("import-hf", str(hf), str(root / "ours")) == 0
    return request.param, root


def _gap(run: Path, hf: Path) -> tuple[float, float]:
    """max |ours - transformers| / max |transformers' logit|, and that max."""
    from megatron_gnmr.interop.hf import judge
    from megatron_gnmr.interop.hf.export import logits_of

    ids = tokens(600)
    theirs = judge.logits(judge.load(hf), ids)
    return relative_gap(logits_of(run, ids), theirs), float(theirs.abs().max())


def test_an_imported_model_gives_transformers_logits(imported):
    cls, root = imported
    gap, largest = _gap(root / "ours", root / "hf")
    print(f"\nimported {cls}: max |ours - transformers| / max |logit| = {gap:.2e} "
          f"(max |logit| {largest:.2f})")
    assert gap <= BOUND
    assert largest > 0.1  # the logits are not near zero: the bound bites


@pytest.mark.parametrize("cls,name,defect", CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_a_defect_the_importer_cannot_see_breaks_the_bound(tmp_path_factory, cls, name, defect):
    root = tmp_path_factory.mktemp(f"{cls}-{name}")
    RANDOM_MODELS[cls](root / "hf")
    shutil.copytree(root / "hf", root / "bad")
    defect(root / "bad")
    assert cli("import-hf", str(root / "bad"), str(root / "ours")) == 0
    gap, _ = _gap(root / "ours", root / "hf")
    assert gap > 100 * BOUND, gap


def test_export_of_the_import_is_the_original_bit_for_bit(imported, tmp_path):
    from safetensors.torch import load_file

    cls, root = imported
    assert cli("export-hf", str(root / "ours"), str(tmp_path / "back"), "--dtype", "fp32") == 0
    original = load_file(str(root / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert original.keys() == back.keys() and len(original) == TENSORS[cls]
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    theirs = json.loads((root / "hf" / "config.json").read_text())
    ours = json.loads((tmp_path / "back" / "config.json").read_text())
    assert ours["architectures"] == [EXPORTED_AS.get(cls, cls)]
    for key in (*COMMON_FIELDS, *CONFIG_FIELDS[cls]):
        assert ours[key] == theirs[key], key
