"""The one place that touches torchao's float8 internals, pinned to the versions read.

torchao's public float8 API (`convert_to_float8_training`) swaps `torch.nn.Linear` modules
for its own; megatron's tensor-parallel linears are not `nn.Linear`, and a tensorwise scale
must be the amax over the whole (unsharded) tensor, which needs megatron's TP group. So the
`fp8-torchao` recipe builds its GEMMs from torchao's building blocks instead, the same ones
torchao's own `matmul_with_hp_or_float8_args` uses: `tensor_to_amax` -> (our TP all-reduce)
-> `amax_to_scale` -> `hp_tensor_and_scale_to_float8` gives a `Float8TrainingTensor`, and
`torch.mm` of two of them dispatches to `torch._scaled_mm` with torchao's GEMM settings
(`Float8LinearConfig.from_recipe_name`, a public API). Read in torchao v0.16.0, v0.17.0 and
v0.18.0 (`float8_utils.py`, `float8_training_tensor.py`: same signatures); tested with 0.18.
`tests/test_torchao_backend.py` fails loudly if a signature or a numeric convention changes.
"""

from __future__ import annotations

import functools
import logging

import torch

from megatron_gnmr.errors import UserError

TESTED = ((0, 16), (0, 19))  # [first, last) torchao minor versions whose internals were read
TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@functools.lru_cache(maxsize=None)
def torchao_version() -> tuple[int, int] | None:
    # torchao logs at import that its CUDA kernels do not load (expected without a GPU) and
    # torch logs a deprecation about torchao's enums: neither is the user's to act on.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao
    except ImportError:
        return None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    major, minor = (int(part) for part in torchao.__version__.split(".")[:2])
    return major, minor


def require_torchao() -> None:
    """A UserError unless a torchao whose internals this module was written against is
    installed."""
    version = torchao_version()
    if version is None:
        raise UserError("--precision-recipe fp8-torchao needs torchao: pip install "
                        "'torchao>=0.16,<0.19' (or `pip install -e .[torchao]`)")
    if not TESTED[0] <= version < TESTED[1]:
        raise UserError(f"--precision-recipe fp8-torchao: torchao {version[0]}.{version[1]} "
                        "is not a version this backend was written against (0.16-0.18); "
                        "pip install 'torchao>=0.16,<0.19'")


@functools.lru_cache(maxsize=None)
def mm_config(granularity: str):
    """torchao's GEMM settings (fast accumulation in the forward GEMM only) for a recipe."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    recipe = Float8LinearConfig.from_recipe_name(
        "tensorwise" if granularity == "tensor" else "rowwise")
    gemms = (recipe.gemm_config_output, recipe.gemm_config_grad_input,
             recipe.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(False, gemm.use_fast_accum, False, False)
                            for gemm in gemms))


def cast(tensor: torch.Tensor, fmt: str, granularity: str, amax_dim: int, role: str,
         pow2: bool, tp_group=None):
    """`tensor` (2-D) as a torchao Float8TrainingTensor. `granularity` is `tensor` (one
    scale) or `row` (one scale per slice along `amax_dim`'s complement, i.e. the amax is
    taken over `amax_dim`); `tp_group`, when given, makes the amax the maximum over the
    tensor-parallel shards (the whole tensor's, as on one rank)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    tensorwise = granularity == "tensor"
    scaling = ScalingGranularity.TENSORWISE if tensorwise else ScalingGranularity.AXISWISE
    axis = None if tensorwise else amax_dim
    amax = tensor_to_amax(tensor, False, None, scaling, axis)
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    dtype = TORCH_DTYPES[fmt]
    scale = amax_to_scale(amax, dtype, pow2)
    return hp_tensor_and_scale_to_float8(tensor, scale, dtype, mm_config(granularity),
                                         getattr(GemmInputRole, role), axis)


def dequantized(fp8_tensor) -> torch.Tensor:
    """The high-precision values a Float8TrainingTensor stands for (for the qerr probes)."""
    return fp8_tensor.to_original_precision()
