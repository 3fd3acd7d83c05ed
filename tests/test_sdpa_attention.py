"""Core attention through torch's SDPA (issue 59 item 1): its output and the gradients it
hands back to Q, K and V against attention written out in float64 (dense and GQA, causal, a
given mask, a given softmax scale, megatron's query-key layer scaling), against megatron's
own unfused attention, its dropout drawn from the model-parallel RNG tracker, and which
core attention the local layer spec picks for which flags."""

import math

import pytest
import torch

from megatron_gnmr.arguments import parse_config

SEQ, BATCH, HEADS, D_HEAD = 12, 2, 4, 8


@pytest.fixture(scope="module")
def megatron_state():
    """megatron's parallel state of one rank (its attention reads the TP group) and its
    model-parallel RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_gnmr.platform import apply_cpu_patches

    apply_cpu_patches()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _config(groups=HEADS, dropout=0.0, dtype=torch.float32, **fields):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=4, hidden_size=HEADS * D_HEAD, num_attention_heads=HEADS,
                             num_query_groups=groups, kv_channels=D_HEAD,
                             attention_dropout=dropout, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
                             **fields)


def _attention(cls, config, mask_type="causal", layer_number=1, softmax_scale=None):
    from megatron.core.transformer.enums import AttnMaskType

    return cls(config=config, layer_number=layer_number,
               attn_mask_type=AttnMaskType[mask_type], attention_type="self",
               softmax_scale=softmax_scale)


def _operands(groups=HEADS, seed=0, dtype=torch.float32):
    """query [seq, batch, heads, d], key and value [seq, batch, groups, d], the output's
    gradient [seq, batch, heads x d] (megatron's layouts)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, D_HEAD, generator=g)
    k, v = (torch.randn(SEQ, BATCH, groups, D_HEAD, generator=g) for _ in range(2))
    grad = torch.randn(SEQ, BATCH, HEADS * D_HEAD, generator=g)
    return [t.to(dtype) for t in (q, k, v)], grad.to(dtype)


def reference(q, k, v, grad, scale, masked=None):
    """Attention in float64, head by head, with autograd: query head h reads key/value head
    h // (heads / groups); `masked` [seq, seq] (True: masked out), else causal."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    per_group = q.shape[2] // k.shape[2]
    if masked is None:
        masked = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    heads = []
    for h in range(q.shape[2]):
        qh, kh, vh = q[:, :, h].transpose(0, 1), k[:, :, h // per_group].transpose(0, 1), \
            v[:, :, h // per_group].transpose(0, 1)  # [batch, seq, d]
        scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(masked, -math.inf)
        heads.append(torch.softmax(scores, -1) @ vh)
    out = torch.stack(heads, 2).transpose(0, 1).reshape(SEQ, BATCH, -1)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def ours(module, q, k, v, grad, mask=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close(got, want, rtol, atol_share):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol_share * b.abs().max(),
                                   msg=name)


@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["dense", "gqa2", "mqa"])
def test_causal_output_and_gradients_against_float64(megatron_state, groups):
    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), grad = _operands(groups)
    module = _attention(SdpaAttention, _config(groups))
    _assert_close(ours(module, q, k, v, grad), reference(q, k, v, grad, D_HEAD ** -0.5),
                  rtol=1e-5, atol_share=1e-5)


def test_bf16_output_and_gradients_against_float64(megatron_state):
    """bf16 operands: within bf16's rounding of the float64 attention of the same values."""
    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), grad = _operands(2, dtype=torch.bfloat16)
    module = _attention(SdpaAttention, _config(2, dtype=torch.bfloat16))
    _assert_close(ours(module, q, k, v, grad), reference(q, k, v, grad, D_HEAD ** -0.5),
                  rtol=2e-2, atol_share=2e-2)


def test_given_softmax_scale_and_query_key_layer_scaling(megatron_state):
    """A scale given to the module (MLA gives its own) is the one applied; with
    apply_query_key_layer_scaling megatron divides the scale by the layer number and its
    softmax multiplies it back, so the attention is unchanged."""
    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), grad = _operands(2, seed=1)
    given = _attention(SdpaAttention, _config(2), softmax_scale=0.37)
    _assert_close(ours(given, q, k, v, grad), reference(q, k, v, grad, 0.37),
                  rtol=1e-5, atol_share=1e-5)
    layered = _attention(SdpaAttention, _config(2, apply_query_key_layer_scaling=True,
                                                fp16=False), layer_number=3)
    _assert_close(ours(layered, q, k, v, grad), reference(q, k, v, grad, D_HEAD ** -0.5),
                  rtol=1e-5, atol_share=1e-5)


def test_a_given_mask_is_used_as_megatron_uses_it(megatron_state):
    """A boolean mask (True: masked out) replaces the causal rule, as megatron's softmax
    applies it; every row keeps keys, so megatron's -10000 fill and torch's -inf agree."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), grad = _operands(2, seed=2)
    g = torch.Generator().manual_seed(3)
    masked = torch.rand(SEQ, SEQ, generator=g) < 0.4
    masked[:, 0] = False  # every query keeps a key
    mask = masked[None, None].expand(BATCH, 1, SEQ, SEQ)
    for mask_type in ("padding", "causal"):
        module = _attention(SdpaAttention, _config(2), mask_type)
        got = ours(module, q, k, v, grad, mask)
        _assert_close(got, reference(q, k, v, grad, D_HEAD ** -0.5, masked), rtol=1e-5,
                      atol_share=1e-5)
        megatron = ours(_attention(DotProductAttention, _config(2), mask_type), q, k, v,
                        grad, mask)
        _assert_close(got, tuple(t.double() for t in megatron), rtol=1e-5, atol_share=1e-5)


def test_megatron_unfused_attention_computes_the_same(megatron_state):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), grad = _operands(2, seed=4)
    got = ours(_attention(SdpaAttention, _config(2)), q, k, v, grad)
    megatron = ours(_attention(DotProductAttention, _config(2)), q, k, v, grad)
    _assert_close(got, tuple(t.double() for t in megatron), rtol=1e-5, atol_share=1e-5)


def test_dropout_is_drawn_from_the_model_parallel_tracker(megatron_state):
    """In training, attention dropout: the default generator is untouched (megatron draws it
    inside the tracker's fork), the same tracker state draws the same mask, the mean over
    many draws is the attention without dropout (inverted dropout keeps the expectation), and
    evaluation applies none."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    (q, k, v), _ = _operands(2, seed=5)
    plain = _attention(SdpaAttention, _config(2))(q, k, v, None)
    module = _attention(SdpaAttention, _config(2, dropout=0.3))
    tracker = get_cuda_rng_tracker()
    default_before, tracker_before = torch.get_rng_state(), tracker.get_states()
    first = module(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), default_before)
    assert not torch.allclose(first, plain)
    tracker.set_states(tracker_before)
    assert torch.equal(module(q, k, v, None), first)
    draws = 400
    mean = sum(module(q, k, v, None) for _ in range(draws)) / draws
    assert (mean - plain).abs().mean() < 0.1 * (first - plain).abs().mean()
    module.eval()
    assert torch.equal(module(q, k, v, None), plain)


def test_different_key_and_value_widths(megatron_state):
    """Multi-latent attention's core attention: query/key heads wider than value heads."""
    from megatron_gnmr.precision.sdpa_attention import SdpaAttention

    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(SEQ, BATCH, HEADS, 12, generator=g) for _ in range(2))
    v = torch.randn(SEQ, BATCH, HEADS, D_HEAD, generator=g)
    grad = torch.randn(SEQ, BATCH, HEADS * D_HEAD, generator=g)
    module = _attention(SdpaAttention, _config(HEADS), softmax_scale=12 ** -0.5)
    _assert_close(ours(module, q, k, v, grad), reference(q, k, v, grad, 12 ** -0.5),
                  rtol=1e-5, atol_share=1e-5)


LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "4", "--num-query-groups", "2"]


@pytest.mark.parametrize("flags,expected", [
    ([], "SdpaAttention"),
    (["--attention-backend", "flash"], "SdpaAttention"),
    (["--precision-recipe", "fp8-emulated"], "SdpaAttention"),
    (["--attention-backend", "local"], "DotProductAttention"),
    (["--attention-backend", "unfused"], "DotProductAttention"),
    (["--attention-precision", "fp8"], "EmulatedFlashAttention"),
    (["--attention-fault-bits", "1"], "EmulatedFlashAttention"),
    (["--emulated-attention"], "EmulatedFlashAttention"),
])
def test_the_local_layer_spec_picks_the_core_attention(flags, expected):
    """SDPA wherever the core attention is not an emulated unit; megatron's unfused attention
    behind --attention-backend local (or unfused); the emulated unit where a run asks for
    low-precision attention or a fault."""
    from megatron_gnmr.model import layer_spec
    from megatron_gnmr.platform import megatron_compat

    spec = layer_spec(parse_config([*LLAMA, *flags]))
    assert megatron_compat.attention_submodules(spec).core_attention.__name__ == expected
