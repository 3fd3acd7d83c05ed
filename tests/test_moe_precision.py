"""Precision recipes inside a DeepSeek-style MoE layer (one process, EP=1): one expert unit
switched alone, the dispatch quantization against a float64 reference, the router in high
precision."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller.units import UnitShape, canonical_unit_names, local_unit_modules
from megatron_gnmr.model import bind_precision, build_gpt_model, transformer_config
from megatron_gnmr.precision.dispatch import install_dispatch_quantization, quantize_for_dispatch
from megatron_gnmr.precision.plan import PrecisionPlan
from tests.helpers import TINY

EXPERTS = 4
DEEPSEEK_MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", "2",
                "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
LAYER0 = "decoder.layers.0."
EXPERT_LINEARS = [f"mlp.experts.local_experts.{e}.linear_fc{i}" for e in range(EXPERTS)
                  for i in (1, 2)]
OTHER_LINEARS = ["self_attention.linear_qkv", "self_attention.linear_proj",
                 "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    distributed.initialize(parse_config([*TINY, *DEEPSEEK_MOE]))
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _model(recipe: str, plan: PrecisionPlan | None = None, extra=()):
    from megatron_gnmr.training.distributed import set_seeds

    config = parse_config([*TINY, *DEEPSEEK_MOE, "--precision-recipe", recipe, *extra])
    set_seeds(7)
    model = build_gpt_model(config, transformer_config(config), vocab_size=512)
    if plan is not None:
        units = local_unit_modules([model], UnitShape.of(config))
        bind_precision(units, config, plan)
    return model


def _forward(model, names):
    """(input, output) of each named module of layer 0 in one forward of a fixed batch."""
    captured = {}
    hooks = [model.get_submodule(LAYER0 + name).register_forward_hook(
        lambda module, args, out, name=name: captured.__setitem__(
            name, (args[0].detach().clone(), out[0].detach().clone())))
        for name in names]
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (2, 64), generator=generator)
    model(tokens, torch.arange(64).expand(2, 64), None)
    for hook in hooks:
        hook.remove()
    return captured


def test_shared_and_routed_experts_are_units():
    names = canonical_unit_names(61, num_experts=256, shared_experts=True)  # DeepSeek-V3
    assert len(names) == 61 * (2 + 2 + 256 * 2) and len(set(names)) == len(names)
    assert names[2:6] == ["layers.0.mlp.shared_experts.linear_fc1",
                          "layers.0.mlp.shared_experts.linear_fc2",
                          "layers.0.mlp.experts.0.linear_fc1", "layers.0.mlp.experts.0.linear_fc2"]


@pytest.mark.parametrize("recipe", ["fp8-emulated", "deepseek"])
def test_one_expert_switched_alone_changes_only_that_expert(megatron_world, recipe):
    switched = "layers.0.mlp.experts.2.linear_fc1"
    names = EXPERT_LINEARS + OTHER_LINEARS
    low = _forward(_model(recipe, PrecisionPlan()), names)
    one = _forward(_model(recipe, PrecisionPlan(recovery=frozenset({switched}))), names)
    changed = {name for name in names if not torch.equal(low[name][1], one[name][1])}
    # the switched fc1, and the fc2 of the same expert, which reads fc1's output
    assert changed == {"mlp.experts.local_experts.2.linear_fc1",
                       "mlp.experts.local_experts.2.linear_fc2"}
    x, y = one["mlp.experts.local_experts.2.linear_fc1"]
    assert x.shape[0] > 0, "the switched expert should receive tokens"
    if recipe == "fp8-emulated":  # recovery is exact: the plain GEMM of what it received
        weight = _model("none").get_submodule(LAYER0 + "mlp.experts.local_experts.2.linear_fc1")
        assert torch.equal(y, torch.matmul(x, weight.weight.t()))


def _e4m3_tiles_float64(x: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's dispatch quantization written out: per token, 128-element tiles, scale
    2^floor(log2(448 / amax)), round to nearest even in E4M3 (ml_dtypes), divide back."""
    out = np.empty_like(x)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], 128):
            tile = x[row, start:start + 128].astype(np.float64)
            amax = np.abs(tile).max()
            scale = 2.0 ** math.floor(math.log2(448.0 / amax)) if amax > 0 else 1.0
            rounded = (tile * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[row, start:start + 128] = rounded / scale
    return out


def test_dispatch_quantization_matches_a_float64_reference_and_passes_gradients():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(37, 300, generator=generator) * torch.logspace(-3, 2, 300)
    tokens[5] = 0.0  # a zero tile keeps scale 1
    tokens.requires_grad_(True)
    quantized = quantize_for_dispatch(tokens)
    np.testing.assert_array_equal(quantized.detach().double().numpy(),
                                  _e4m3_tiles_float64(tokens.detach().numpy()))
    upstream = torch.randn(37, 300, generator=generator)
    quantized.backward(upstream)
    assert torch.equal(tokens.grad, upstream)  # the gradient's way back is not rounded


def test_dispatch_quantization_reaches_the_experts_and_not_the_router(megatron_world):
    plain = _model("deepseek", PrecisionPlan())
    quantized = _model("deepseek", PrecisionPlan(), ["--moe-dispatch-quant"])
    layer = quantized.get_submodule(LAYER0 + "mlp")
    seen = {}
    quantizing_dispatch, send = layer.dispatch, layer.token_dispatcher.token_dispatch

    def record_unquantized(hidden_states, probs):
        seen["before"] = hidden_states.detach().clone()
        return quantizing_dispatch(hidden_states, probs)

    def record_sent(hidden_states, probs):  # megatron's all-to-all
        seen["sent"] = hidden_states.detach().clone()
        return send(hidden_states, probs)

    layer.dispatch, layer.token_dispatcher.token_dispatch = record_unquantized, record_sent
    names = OTHER_LINEARS
    got = _forward(quantized, ["mlp.router", *names])
    expected = _forward(plain, ["mlp.router", *names])
    np.testing.assert_array_equal(seen["sent"].double().numpy(),
                                  _e4m3_tiles_float64(seen["before"].numpy()))
    assert not torch.equal(seen["sent"], seen["before"])
    for name in ["mlp.router", *names]:  # the router and the shared expert read BF16 tokens
        assert torch.equal(got[name][1], expected[name][1]), name
    assert install_dispatch_quantization([plain]) == 2  # one per MoE layer
