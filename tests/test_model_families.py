"""The model-family seam, proven by DeepSeek's multi-latent attention: its linears are units
(named, costed and routed like LLaMA's), the attention monitor's query and key maps are
what megatron's MLA computes, its settings are refused on a LLaMA run, and nothing outside
the LLaMA family file names LLaMA's fused QKV projection."""

import re

import numpy as np
import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller.units import UnitShape
from megatron_gnmr.errors import UserError
from megatron_gnmr.validation import validate
from tests.helpers import REPO, TINY

# (TINY's GQA groups undone: MLA has one key per head)
MLA = ["--model-family", "deepseek-mla", "--num-query-groups", "4", "--kv-lora-rank", "32",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
Q_LORA = ["--q-lora-rank", "24"]


def _config(*flags):
    return parse_config([*TINY, *MLA, *flags])


# -- units -----------------------------------------------------------------------------------
def test_mla_units_in_canonical_order():
    names = UnitShape.of(_config()).names()
    assert names[:6] == [f"layers.0.{n}" for n in (
        "self_attention.linear_q_proj", "self_attention.linear_kv_down_proj",
        "self_attention.linear_kv_up_proj", "self_attention.linear_proj",
        "mlp.linear_fc1", "mlp.linear_fc2")]
    compressed = UnitShape.of(_config(*Q_LORA)).names()
    assert compressed[:3] == ["layers.0.self_attention.linear_q_down_proj",
                              "layers.0.self_attention.linear_q_up_proj",
                              "layers.0.self_attention.linear_kv_down_proj"]
    # a switchable core attention sits before the output projection, in every family
    switchable = UnitShape.of_run(_config("--attention-precision", "fp8")).names()
    assert switchable[3:5] == ["layers.0.self_attention.core_attention",
                               "layers.0.self_attention.linear_proj"]


def test_mla_gemm_flops_by_hand():
    """TINY: d_model 64, 4 heads, ffn 176, seq 64, 8 sequences a step; MLA widths 32 / 16 +
    8 / 12: per token q 64 x 96, kv_down 64 x 40, kv_up 32 x 112, proj 48 x 64, core attention
    64 x 4 x (24 + 12), fc1 64 x 352, fc2 176 x 64; x3 GEMMs per step, x 512 tokens."""
    from megatron_gnmr.precision.unit_costs import unit_costs

    config = _config("--attention-precision", "fp8")
    names = UnitShape.of_run(config).names()[:7]
    per_token = [64 * 96, 64 * 40, 32 * 112, 64 * 4 * 36, 48 * 64, 64 * 352, 176 * 64]
    np.testing.assert_array_equal(unit_costs(config, names),
                                  [3.0 * 512 * macs for macs in per_token])


def test_gemm_shapes_split_the_mla_linears_as_megatron_does():
    from megatron_gnmr.precision.gemm_shapes import unit_gemms

    config = _config(*Q_LORA, "--tensor-model-parallel-size", "2")
    shapes = {g.unit: (g.in_features, g.out_features) for g in unit_gemms(config)}
    assert shapes["linear_q_down_proj"] == (64, 12)  # column-parallel: N split
    assert shapes["linear_kv_down_proj"] == (64, 20)
    assert shapes["linear_kv_up_proj"] == (32, 56)
    assert shapes["linear_proj"] == (24, 64)  # row-parallel: K split


# -- settings --------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--kv-lora-rank", "64"], "--kv-lora-rank"),  # an MLA setting on a LLaMA run
    ([*MLA, "--num-query-groups", "2"], "--num-query-groups"),
    ([*MLA, "--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim"),
    ([*MLA, "--kv-lora-rank", "31", "--tensor-model-parallel-size", "2"], "--kv-lora-rank"),
    (["--model-family", "mamba"], "--model-family"),
])
def test_a_bad_family_setting_is_refused_by_name(flags, named):
    with pytest.raises(UserError, match=re.escape(named)):
        validate(parse_config([*TINY, *flags]), world_size=2)


def test_resume_accepts_a_checkpoint_older_than_a_setting_at_its_default():
    from megatron_gnmr.controller.config import UNITS_FORMER_DEFAULT
    from megatron_gnmr.training.resume_contract import check_resume, resume_settings

    current = resume_settings(parse_config([*TINY, "--gnmr", "--lora"]), "d", 512, 1)
    older = {name: value for name, value in current.items()
             if name not in ("--model-family", "--kv-lora-rank")}
    older["--gnmr-units"] = UNITS_FORMER_DEFAULT
    older["--lora-target-modules"] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    check_resume("run", older, current)
    older["--lora-target-modules"] = ["linear_fc1"]  # not a default: the run differs
    with pytest.raises(UserError, match="--lora-target-modules"):
        check_resume("run", older, current)
    older["--lora-target-modules"] = current["--lora-target-modules"]
    mla = resume_settings(parse_config([*TINY, *MLA, "--gnmr"]), "d", 512, 1)
    with pytest.raises(UserError, match="--model-family"):
        check_resume("run", older, mla)


def test_only_the_llama_family_names_its_fused_qkv():
    # the family is three files (its spec, its layout helpers, its Hugging Face mapping);
    # nothing outside them may know how the fused QKV weight is named or laid out
    package = REPO / "megatron_gnmr"
    naming = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                    if "linear_qkv" in path.read_text())
    assert "model_families/llama.py" in naming
    assert [name for name in naming
            if not name.startswith("model_families/llama")] == []


# -- the built model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    distributed.initialize(_config())
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _attention(*flags):
    from megatron_gnmr.model import build_gpt_model, transformer_config
    from megatron_gnmr.training.distributed import set_seeds

    config = _config(*flags)
    set_seeds(3)
    model = build_gpt_model(config, transformer_config(config), vocab_size=512)
    return config, model, model.decoder.layers[0].self_attention


@pytest.mark.parametrize("flags", [[], Q_LORA], ids=["q-direct", "q-latent"])
def test_query_key_maps_are_megatrons_queries_and_keys(megatron_world, flags):
    """What the maps are for: each head's QK product x_i A_h B_h^T x_j^T (SPEC 7.1). At
    position 0 RoPE rotates nothing (megatron's MLA still reorders the RoPE dimensions, evens
    then odds, in both query and key: the product is unchanged), and the content key is
    divided by the latent's RMS, a per-token scale the maps leave out as SPEC 7.1 leaves out
    the input norm (so is the query latent's, with --q-lora-rank). Against float64, for 8
    tokens at position 0."""
    from megatron_gnmr.model_families.deepseek_mla import DEEPSEEK_MLA

    config, _, attention = _attention(*flags)
    generator = torch.Generator().manual_seed(0)
    normed = bool(flags)  # the latents are normalised with a query latent (deepseek_mla.py)
    with torch.no_grad():  # norm weights away from 1, so leaving them out would show
        for norm in ("q_layernorm", "kv_layernorm") if normed else ():
            getattr(attention, norm).weight.uniform_(0.5, 1.5, generator=generator)
        x = torch.randn(1, 8, 64, generator=generator)  # [seq 1, batch 8, d_model]
        query, key, *_ = attention.get_query_key_value_tensors(x)
    maps = DEEPSEEK_MLA.query_key_maps(DEEPSEEK_MLA.attention_weights(attention), attention,
                                       None)
    tokens = x[0].double()
    def rms(projection, rows):
        latent = tokens @ projection.weight.detach().double()[:rows].T
        return torch.sqrt(latent.pow(2).mean(-1, keepdim=True) + config.model.norm_epsilon)

    query_scale = rms(attention.linear_q_down_proj, 24) if normed else 1.0
    key_scale = rms(attention.linear_kv_down_proj, 32) if normed else 1.0
    for h in range(4):
        queries, keys = tokens @ maps.queries[h] / query_scale, tokens @ maps.keys[h]
        keys[:, :16] /= key_scale
        np.testing.assert_allclose(query[0, :, h, :16].double(), queries[:, :16], rtol=1e-5,
                                   atol=1e-6)  # the content parts, element by element
        np.testing.assert_allclose(key[0, :, h, :16].double(), keys[:, :16], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(query[0, :, h].double() @ key[0, :, h].double().T,
                                   queries @ keys.T, rtol=1e-5, atol=1e-6)


def test_every_mla_linear_is_path_routed_and_its_low_path_quantizes(megatron_world):
    from megatron_gnmr.precision.linear import _PathRoutedLinear
    from megatron_gnmr.precision.paths import GemmPath
    from megatron_gnmr.precision.scaling import QuantSpec

    _, _, attention = _attention(*Q_LORA, "--precision-recipe", "fp8-emulated")
    for name in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                 "linear_kv_up_proj", "linear_proj"):
        assert isinstance(getattr(attention, name), _PathRoutedLinear), name

    class Runtime:  # the one question a path-routed linear asks
        def __init__(self, path):
            self.path = path

        def path_for(self, unit):
            return self.path

        def probe_for(self, unit):
            return None

    down = attention.linear_kv_down_proj
    x = torch.randn(4, 2, 64)
    exact = torch.nn.functional.linear(x, down.weight)
    down.precision_runtime = Runtime(GemmPath("low", QuantSpec("e4m3"), QuantSpec("e4m3")))
    low, _ = down(x)
    down.precision_runtime = None
    plain, _ = down(x)
    torch.testing.assert_close(plain, exact)
    assert 1e-4 < (low - exact).abs().max() / exact.abs().max() < 0.2



def test_lora_adapts_every_mla_linear_the_model_has_by_default():
    """Without --lora-target-modules LoRA adapts every unit linear: with and without a query
    latent (a default naming the latent's linears was refused on a model without one)."""
    from megatron_gnmr.lora.adapters import lora_units

    for flags, query in (([], ["linear_q_proj"]), (Q_LORA, ["linear_q_down_proj",
                                                             "linear_q_up_proj"])):
        config = _config(*flags, "--lora", "--lora-dim", "8")
        validate(config, world_size=1)
        adapted = [name for name in UnitShape.of(config).names() if lora_units(config)(name)]
        assert [name.rsplit(".", 1)[1] for name in adapted[:len(query) + 5]] == [
            *query, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1",
            "linear_fc2"]
