"""What torch's float8 GEMM (`torch._scaled_mm`) costs on this machine, measured.

On a GPU with FP8 tensor cores it is the fast path. On a CPU it may be a reference kernel:
measured at 56 ms for a 128^3 GEMM on one Xeon (AVX-512, AMX; torch 2.13.0), 330x to 2,300x a
float32 matmul of the same size, against 0.2 ms (4x) on an AMD EPYC with the same wheel. The
`fp8-torchao` recipe says what it will cost at the start of a CPU run, and the test suite
sizes its real-FP8 training runs by it (`tests/float8_budget.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Float8GemmSpeed:
    size: int
    """The GEMM measured: size x size x size."""
    float8_s: float
    float32_s: float

    @property
    def ratio(self) -> float:
        """float8 time / float32 time at this size."""
        return self.float8_s / self.float32_s

    @property
    def float8_macs_per_s(self) -> float:
        return self.size**3 / self.float8_s

    def describe(self) -> str:
        return (f"torch's float8 GEMM at {self.size}^3: {self.float8_s * 1e3:.2f} ms, "
                f"{self.ratio:,.0f}x float32 ({self.float8_macs_per_s / 1e6:,.0f} M MAC/s)")


def _best_of(function, repeats: int) -> float:
    function()  # warm-up (kernel choice, allocation)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def measure(size: int = 128, device: str | torch.device = "cpu") -> Float8GemmSpeed:
    """Time one size^3 `_scaled_mm` (tensorwise scales, float32 out) against a float32 matmul
    of the same size; best of a few runs, about 0.2 s on a slow reference kernel."""
    generator = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(size, size, generator=generator).to(device) for _ in range(2))
    a8 = a32.to(torch.float8_e4m3fn)
    b8 = b32.to(torch.float8_e4m3fn).t()  # _scaled_mm wants its second operand column-major
    one = torch.ones((), device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def float8():
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
        sync()

    def float32():
        torch.matmul(a32, b32)
        sync()

    return Float8GemmSpeed(size, _best_of(float8, 2), _best_of(float32, 5))
