"""What this machine can run: CUDA, Transformer Engine, FP8 GEMMs; each with the reason.

Modelled on `te.is_fp8_available(return_reason=True)`: a capability that is missing says
why, so an error message can tell the user what to install or which flag to change.
TE is imported behind `except (ImportError, RuntimeError, OSError)`: a TE wheel without its
CUDA libraries raises RuntimeError('cudnn shared object not found.') at import, not
ImportError, and megatron-core itself only catches ImportError.
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


@functools.lru_cache(maxsize=None)
def cuda() -> Capability:
    if torch.cuda.is_available():
        return Capability(True, f"CUDA device: {torch.cuda.get_device_name(0)}")
    if torch.version.cuda is None:
        return Capability(False, "torch is a CPU-only build (torch.version.cuda is None)")
    return Capability(False, "torch has CUDA support but no CUDA device is visible")


@functools.lru_cache(maxsize=None)
def _import_te() -> tuple[ModuleType | None, str]:
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except (ImportError, RuntimeError, OSError) as error:
        return None, f"transformer_engine cannot be imported: {type(error).__name__}: {error}"
    return te, f"transformer_engine {getattr(te, '__version__', '?')}"


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


def te_fp8() -> Capability:
    """FP8 through TE on this device (Hopper/Ada/Blackwell), with TE's own reason."""
    if not transformer_engine():
        return transformer_engine()
    te = te_module()
    available, reason = te.fp8.check_fp8_support()
    return Capability(bool(available), reason or "FP8 supported")


def summary() -> dict[str, str]:
    return {
        "cuda": cuda().reason,
        "transformer_engine": transformer_engine().reason,
    }
