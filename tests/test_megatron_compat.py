"""The layer-spec surgery on the installed megatron-core (run on 0.16.1 in the main
environment and on the newest release by scripts/test_newest_megatron.sh).

From 0.18 the local spec's MLP is `functools.partial(MLP.as_mlp_submodule,
submodules=...)`, not a `ModuleSpec` with `.submodules`: the landed code read
`spec.submodules.mlp.submodules` and every emulated recipe failed to build there.
"""

import functools
import subprocess
import sys
import textwrap

import megatron.core
import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from packaging.version import Version

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.model import layer_spec
from megatron_gnmr.model_families import unit_linear_classes
from megatron_gnmr.model_families.llama import LLAMA
from megatron_gnmr.platform import megatron_compat
from megatron_gnmr.precision.linear import EmulatedColumnParallelLinear, EmulatedRowParallelLinear
from tests.helpers import LAUNCH_TIMEOUT_S, REPO

VERSION = Version(megatron.core.__version__.split("+")[0])
EMULATED = {"linear_qkv": EmulatedColumnParallelLinear,
            "linear_proj": EmulatedRowParallelLinear,
            "linear_fc1": EmulatedColumnParallelLinear,
            "linear_fc2": EmulatedRowParallelLinear}


@pytest.mark.parametrize("num_experts", [None, 4], ids=["dense", "moe"])
def test_the_mlp_node_has_this_release_s_form(num_experts):
    mlp = megatron_compat.local_layer_spec(num_experts).submodules.mlp
    assert isinstance(mlp, functools.partial) == (VERSION >= Version("0.18"))
    assert megatron_compat.mlp_submodules(megatron_compat.local_layer_spec(num_experts)) \
        .linear_fc1 is ColumnParallelLinear


@pytest.mark.parametrize("num_experts", [None, 4], ids=["dense", "moe"])
def test_every_emulated_recipe_spec_routes_all_four_unit_linears(num_experts):
    flags = ["--num-experts", str(num_experts)] if num_experts else []
    for recipe in ("fp8-emulated", "deepseek", "act-quant", "fp8-torchao"):
        spec = layer_spec(parse_config([*flags, "--precision-recipe", recipe]))
        assert unit_linear_classes(spec, LLAMA) == EMULATED, recipe
    plain = megatron_compat.local_layer_spec(num_experts)
    assert unit_linear_classes(plain, LLAMA) == {
        "linear_qkv": ColumnParallelLinear, "linear_proj": RowParallelLinear,
        "linear_fc1": ColumnParallelLinear, "linear_fc2": RowParallelLinear}
    # the original spec is left as it was (the replacement works on a copy)
    assert unit_linear_classes(layer_spec(parse_config(flags)), LLAMA) == \
        unit_linear_classes(plain, LLAMA)


MOE_WITHOUT_TE_ON_CUDA = textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True  # a CUDA machine without Transformer Engine
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.platform import device
    from megatron_gnmr.training import distributed
    device.distributed_backend = lambda: "gloo"  # the boundary: no real GPU here
    device.select_device = lambda: None
    try:
        distributed.initialize(parse_config([]))
    except Exception:
        pass  # seeding a pretend GPU fails later; the binding comes first
    from megatron.core.transformer.moe import moe_utils
    print(hasattr(moe_utils, "te_general_gemm"))
""")


def test_moe_helpers_are_bound_without_te_on_a_cuda_machine_too():
    """megatron-core 0.16.1 binds `te_general_gemm` only inside its TE import block and the
    router reads it every forward: without TE every MoE model fails with a NameError, on a
    GPU as on a CPU. The binding once came with the CPU patches only (skipped with CUDA)."""
    out = subprocess.run([sys.executable, "-c", MOE_WITHOUT_TE_ON_CUDA], capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT_S, cwd=REPO)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-3000:]


def test_the_attention_backend_choices_are_megatron_cores():
    """--attention-backend's choices are a limit on the field (checked without importing
    megatron); they must be the names of megatron-core's AttnBackend, release after release."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_gnmr.config import ATTENTION_BACKENDS

    assert set(ATTENTION_BACKENDS) == set(AttnBackend.__members__)
