"""torch.compile where it runs, eager where it cannot (said once), and the count of graphs it
compiled.

`CompiledFunction` wraps a pure tensor function: compiled on its first call (torch.compile,
inductor's C++ or Triton code), its compiled variants cached by dynamo across steps and by
inductor's on-disk cache across processes. Where compilation cannot run (no C++ compiler, a
Python or platform dynamo does not support, a backend that fails) the first failure turns
compilation off for the whole process and says so once, as a `CompileFallbackWarning`
naming the reason; every call then runs the function eagerly, which computes the same
values (the compiled quantizers are bit-identical to eager, `tests/test_compiled_quantizers.py`).
Inside a region already being compiled (a compiled transformer layer, `--compile`) the
wrapper steps aside and the function is traced into that region.

`compiled_graphs()` counts the graphs dynamo has compiled in this process, all regions
together: what `--compile` logs as recompilations after its first step.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable

import torch


class CompileFallbackWarning(RuntimeWarning):
    """torch.compile could not run here: the functions run eagerly (same values, slower)."""


_FALLBACK_REASON: str | None = None
"""Why compilation is off in this process (None: it is on)."""


def fallback_reason() -> str | None:
    """Why this process runs the compiled functions eagerly, or None."""
    return _FALLBACK_REASON


def fall_back(reason: str) -> None:
    """Turn compilation off for the process; the first reason is said, once."""
    global _FALLBACK_REASON
    if _FALLBACK_REASON is not None:
        return
    _FALLBACK_REASON = reason
    warnings.warn(f"torch.compile cannot run here, so the emulated quantizers and compiled "
                  f"layers run eagerly (same values, slower): {reason}",
                  CompileFallbackWarning, stacklevel=3)


def compile_errors() -> tuple[type, ...]:
    """What a failed compilation raises: dynamo's exceptions (inductor's compiler errors are
    wrapped in them), and the RuntimeError torch.compile raises where dynamo does not run."""
    return (torch._dynamo.exc.TorchDynamoException, RuntimeError)


def compile_options(recompile_limit: int) -> dict:
    """torch.compile's keywords that bound one region's variants, where this torch has them
    (a per-call recompile limit and an isolated cache arrived in torch 2.13; before, the
    global limit is raised to at least `recompile_limit`)."""
    accepted = inspect.signature(torch.compile).parameters
    if "recompile_limit" in accepted and "isolate_recompiles" in accepted:
        return {"recompile_limit": recompile_limit, "isolate_recompiles": True}
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), recompile_limit))
    return {}


class CompiledFunction:
    """`fn` compiled on first use (`dynamic`: one graph per shape class instead of one per
    shape), eager where compilation cannot run."""

    def __init__(self, fn: Callable, name: str, dynamic: bool | None = True,
                 recompile_limit: int = 64):
        self.fn, self.name = fn, name
        self.dynamic, self.recompile_limit = dynamic, recompile_limit
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        if _FALLBACK_REASON is not None or torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, dynamic=self.dynamic,
                                               **compile_options(self.recompile_limit))
            return self._compiled(*args, **kwargs)
        except compile_errors() as error:
            if not _is_compile_failure(error):
                raise
            fall_back(f"{self.name}: {_first_line(error)}")
            return self.fn(*args, **kwargs)


def _is_compile_failure(error: Exception) -> bool:
    """A dynamo or backend failure, or torch.compile refusing this Python or platform (not
    an error of the function itself, which eager would raise the same way)."""
    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return True
    text = str(error)
    return "torch.compile" in text or "Dynamo is not supported" in text


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (every region, every variant)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
