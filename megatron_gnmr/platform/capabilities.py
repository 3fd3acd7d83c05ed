"""What this machine can run: CUDA, Transformer Engine, each FP8 recipe; each with the reason.

Modelled on `te.is_fp8_available(return_reason=True)`: a capability that is missing says
why, so an error message can tell the user what to install or which flag to change.
TE is imported behind `except (ImportError, RuntimeError, OSError)`: a TE wheel without its
CUDA libraries raises RuntimeError('cudnn shared object not found.') at import, not
ImportError, and megatron-core itself only catches ImportError.

TE's own availability functions are the authority on what a GPU supports (TE >= 2.9, all
exported from `transformer_engine.pytorch`): `is_fp8_available` (current scaling: SM 8.9+),
`is_fp8_block_scaling_available` (SM 9.0+ and CUDA >= 12.9), `is_mxfp8_available`
(SM 10.x). Its version is `transformer_engine.__version__` (the `pytorch` submodule has none).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class Capability:
    available: bool
    reason: str  # why not, or a one-line description of what was found

    def __bool__(self) -> bool:
        return self.available


# --fp8-recipe -> the TE function that says whether this GPU runs it.
TE_RECIPE_CHECKS = {
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}


@functools.lru_cache(maxsize=None)
def cuda() -> Capability:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return Capability(True, f"CUDA device: {torch.cuda.get_device_name(0)} "
                                f"(SM {major}.{minor}, CUDA {torch.version.cuda})")
    if torch.version.cuda is None:
        return Capability(False, "torch is a CPU-only build (torch.version.cuda is None)")
    return Capability(False, "torch has CUDA support but no CUDA device is visible")


@functools.lru_cache(maxsize=None)
def _import_te() -> tuple[ModuleType | None, str]:
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except (ImportError, RuntimeError, OSError) as error:
        return None, f"transformer_engine cannot be imported: {type(error).__name__}: {error}"
    return te, f"transformer_engine {getattr(transformer_engine, '__version__', '?')}"


def transformer_engine() -> Capability:
    if not cuda():
        return Capability(False, f"Transformer Engine needs CUDA: {cuda().reason}")
    te, reason = _import_te()
    return Capability(te is not None, reason)


def te_module() -> ModuleType:
    """The imported `transformer_engine.pytorch`; call only after `transformer_engine()`."""
    te, reason = _import_te()
    if te is None:
        raise RuntimeError(reason)
    return te


def te_recipe(fp8_recipe: str) -> Capability:
    """Whether TE runs `--fp8-recipe fp8_recipe` on this GPU, in TE's own words."""
    found = transformer_engine()
    if not found:
        return found
    te, version = _import_te()
    check = getattr(te, TE_RECIPE_CHECKS[fp8_recipe], None)
    if check is None:
        return Capability(False, f"{version} has no {TE_RECIPE_CHECKS[fp8_recipe]}(); "
                                 "megatron-core needs transformer-engine >= 2.9")
    available, reason = check(return_reason=True)
    return Capability(bool(available), reason or f"{version}: supported on this GPU")


def gradient_accumulation_fusion(te_layers: bool) -> Capability:
    """Whether weight gradients can be accumulated into `main_grad` inside the GEMM: TE's
    linears do it themselves; megatron's local linears need apex's CUDA extension
    `fused_weight_gradient_mlp_cuda`, and so does the output layer of every GPTModel (a plain
    ColumnParallelLinear, also in the TE spec), which refuses to build without it."""
    if not cuda():
        return Capability(False, f"the fused accumulation is a CUDA kernel: {cuda().reason}")
    if te_layers and not transformer_engine():
        return transformer_engine()
    if not _apex_fused_wgrad():
        where = "the output layer (megatron's plain ColumnParallelLinear, also with TE layers)" \
            if te_layers else "megatron's local linears"
        return Capability(False, f"{where} needs apex's fused_weight_gradient_mlp_cuda "
                                 "extension, not installed")
    return Capability(True, "apex fused_weight_gradient_mlp_cuda"
                      + (" and Transformer Engine's linears" if te_layers else ""))


def _apex_fused_wgrad() -> bool:
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def report() -> list[tuple[str, Capability]]:
    """Every capability, for `scripts/gpu_check.sh` and the test header."""
    lines = [("cuda", cuda()), ("transformer_engine", transformer_engine())]
    if transformer_engine():
        lines += [(f"te-fp8 {name}", te_recipe(name)) for name in TE_RECIPE_CHECKS]
    return lines
