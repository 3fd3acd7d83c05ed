"""The Transformer Engine path, checked without TE: te-fp8 validation through the public
error path with TE's availability functions faked at that boundary only, the TE spec asked
with the MoE settings, per-unit switching of megatron's linears (experts included), and unit
norms that leave TE's fused norm weights out."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.llama import LLAMA
from megatron_gnmr.platform import capabilities, megatron_compat
from megatron_gnmr.validation import validate
from tests.helpers import TINY

HOPPER = {"is_fp8_available": (True, ""),
          "is_fp8_block_scaling_available": (True, ""),
          "is_mxfp8_available": (False, "Device compute capability 10.0 or higher required "
                                        "for MXFP8 execution.")}
HOPPER_OLD_CUDA = dict(HOPPER, is_fp8_block_scaling_available=(
    False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."))
BLACKWELL = dict(HOPPER, is_mxfp8_available=(True, ""))
AMPERE = {"is_fp8_available": (False, "Device compute capability 8.9 or higher required for "
                                      "FP8 execution."),
          "is_fp8_block_scaling_available": (False, "needs SM 9.0"),
          "is_mxfp8_available": (False, "needs SM 10.0")}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU and a TE whose availability functions answer as the given table says."""

    def install(answers: dict | None):
        monkeypatch.setattr(capabilities, "cuda", lambda: capabilities.Capability(True, "GPU"))
        if answers is None:
            te = None, "transformer_engine cannot be imported: ImportError: no module"
        else:
            functions = {name: (lambda answer: lambda return_reason=False: answer)(answer)
                         for name, answer in answers.items()}
            te = SimpleNamespace(**functions), "transformer_engine 2.11.0"
        monkeypatch.setattr(capabilities, "_import_te", lambda: te)

    return install


def check(flags: list[str]) -> None:
    config = parse_config([*TINY, "--hidden-size", "128", "--ffn-hidden-size", "256",
                           "--precision-recipe", "te-fp8", *flags])
    validate(config, world_size=1)


def error(flags: list[str]) -> str:
    with pytest.raises(UserError) as caught:
        check(flags)
    return str(caught.value)


def test_supported_recipes_pass(fake_gpu):
    fake_gpu(HOPPER)
    check(["--fp8-recipe", "tensorwise"])
    check(["--fp8-recipe", "blockwise", "--fp8-format", "e4m3"])
    fake_gpu(BLACKWELL)
    check(["--fp8-recipe", "mxfp8"])


def test_mxfp8_on_hopper_is_refused_with_te_reason_and_the_alternatives(fake_gpu):
    fake_gpu(HOPPER)
    message = error(["--fp8-recipe", "mxfp8"])
    assert message.startswith("--fp8-recipe mxfp8: Transformer Engine says \"Device compute "
                              "capability 10.0 or higher required for MXFP8 execution.\"")
    assert message.endswith("use --fp8-recipe tensorwise or blockwise")


def test_blockwise_without_cuda_12_9_names_the_reason(fake_gpu):
    fake_gpu(HOPPER_OLD_CUDA)
    message = error(["--fp8-recipe", "blockwise"])
    assert "CUDA >= 12.9" in message and message.endswith("use --fp8-recipe tensorwise")


def test_a_gpu_without_fp8_points_to_emulation(fake_gpu):
    fake_gpu(AMPERE)
    assert "--precision-recipe fp8-emulated" in error(["--fp8-recipe", "tensorwise"])


def test_delayed_and_bad_formats_are_refused_before_te_is_asked(fake_gpu):
    fake_gpu(None)
    assert error(["--fp8-recipe", "delayed"]).startswith("--fp8-recipe delayed is refused")
    assert error(["--fp8-format", "e5m2"]).startswith(
        "--fp8-format (YAML precision.fp8_format) must be one of hybrid, e4m3, got 'e5m2'")
    assert "needs Transformer Engine: transformer_engine cannot be imported" in error([])


def test_shape_rules_per_recipe(fake_gpu):
    fake_gpu(BLACKWELL)
    # K = 72 input features: not a multiple of 16 (every TE FP8 recipe).
    message = error(["--hidden-size", "72", "--num-attention-heads", "4"])
    assert "linear_qkv: K (input features per TP shard) = 72 is not a multiple of 16" in message
    # ffn 176: fine for current scaling (176 % 16 == 0), not for MXFP8 (176 % 32 == 16).
    check(["--ffn-hidden-size", "176"])
    message = error(["--ffn-hidden-size", "176", "--fp8-recipe", "mxfp8"])
    assert "linear_fc2: K (input features per TP shard) = 176 is not a multiple of 32" in message


def test_te_fp8_with_experts_passes_validation(fake_gpu):
    fake_gpu(HOPPER)
    check(["--num-experts", "4", "--moe-router-topk", "2"])


def test_te_version_comes_from_the_top_level_package(monkeypatch):
    """`transformer_engine.__version__`: the `pytorch` submodule has no version."""
    import sys

    pytorch = SimpleNamespace()
    package = SimpleNamespace(__version__="2.11.0", pytorch=pytorch)
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    capabilities._import_te.cache_clear()
    try:
        te, reason = capabilities._import_te()
        assert te is pytorch and reason == "transformer_engine 2.11.0"
    finally:
        capabilities._import_te.cache_clear()


def test_te_spec_is_asked_with_the_moe_settings(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    asked = {}
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kwargs: asked.update(kwargs) or "spec")
    assert megatron_compat.te_layer_spec(8) == "spec"
    assert asked == {"num_experts": 8, "moe_grouped_gemm": False}


# -- switching, on megatron's own linears standing in for its TE linears -------------------

@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    distributed.initialize(parse_config(TINY))
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_each_unit_switches_alone_dense_and_experts(megatron_world, monkeypatch):
    """A spec made switchable the way the TE spec is: a recovered unit (an expert's fc1
    among them) runs its forward under the disabled FP8 autocast, every other unit not."""
    from megatron_gnmr.controller.units import UnitShape, local_unit_modules
    from megatron_gnmr.model import bind_precision, build_gpt_model, transformer_config
    from megatron_gnmr.precision import te_backend
    from megatron_gnmr.precision.plan import PrecisionPlan

    recovered_during = []
    current = []

    @contextlib.contextmanager
    def disabled():
        recovered_during.append(current[-1])
        yield

    monkeypatch.setattr(te_backend, "disabled_fp8_autocast", disabled)
    # Built without megatron's FP8 settings (they need TE), bound as te-fp8.
    config = parse_config([*TINY, "--num-experts", "4"])
    spec = te_backend.switchable_layer_spec(megatron_compat.local_layer_spec(4), LLAMA)
    monkeypatch.setattr("megatron_gnmr.model.layer_spec", lambda config, moe=True: spec)
    model = build_gpt_model(config, transformer_config(config), vocab_size=512)
    units = local_unit_modules([model], UnitShape(num_layers=2, num_experts=4))
    assert len(units) == 2 * (2 + 4 * 2)
    plan = PrecisionPlan()
    te_config = parse_config([*TINY, "--num-experts", "4", "--precision-recipe", "te-fp8"])
    bind_precision(units, te_config, plan)
    for name, module in units.items():
        assert isinstance(module, te_backend._RecoverySwitch), name
        module.register_forward_pre_hook(lambda m, a, name=name: current.append(name))
    recovered = {"layers.0.self_attention.linear_qkv", "layers.1.mlp.experts.2.linear_fc1"}
    plan.advance(recovered, step=1)
    tokens = torch.randint(0, 512, (2, 64))
    model(tokens, torch.arange(64).expand(2, 64), None, labels=tokens)
    assert set(recovered_during) == recovered and len(recovered_during) == 2


def test_fused_norm_weights_stay_out_of_the_unit(megatron_world):
    """TE's `linear_qkv` holds the input RMSNorm's weight (`layer_norm_weight`): the unit's
    parameters are its GEMM weights only, as with the local spec."""
    from megatron_gnmr.controller.units import UnitRegistry

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(4, 4))
    module.layer_norm_weight = torch.nn.Parameter(torch.ones(4))
    registry = UnitRegistry(["layers.0.self_attention.linear_qkv"], {0: module})
    assert [p.shape for p in registry.local_parameters(0)] == [torch.Size([4, 4])]
    # ... and the norm weight's gradient still counts in the global norm (clipping).
    from megatron_gnmr.controller.grad_stats import GradStats

    module.weight.grad = torch.full((4, 4), 0.5)
    module.layer_norm_weight.grad = torch.full((4,), 3.0)
    stats = GradStats(registry, [module]).compute()
    assert stats.unit_norms.tolist() == [2.0]
    assert stats.total_norm == pytest.approx((4.0 + 36.0) ** 0.5)


def test_gradient_accumulation_fusion_with_te_needs_apex_for_the_output_layer(fake_gpu,
                                                                              monkeypatch):
    """TE's linears fuse the accumulation themselves, but megatron's output layer is a plain
    ColumnParallelLinear in the TE spec too, and it refuses to build without apex's
    fused_weight_gradient_mlp_cuda: refused up front, not at the model build."""
    fake_gpu(HOPPER)
    monkeypatch.setattr(capabilities, "_apex_fused_wgrad", lambda: False)
    message = error(["--gradient-accumulation-fusion"])
    assert message.startswith("--gradient-accumulation-fusion: the output layer")
    assert "fused_weight_gradient_mlp_cuda" in message
    monkeypatch.setattr(capabilities, "_apex_fused_wgrad", lambda: True)
    check(["--gradient-accumulation-fusion"])
