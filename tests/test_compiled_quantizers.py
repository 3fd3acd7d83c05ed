"""The emulated quantizers compiled with torch.compile (issue 59 item 2): bit for bit the eager
quantizers over every format and scaling granularity (NaN, Inf, -0, subnormals and padding
included), one compilation per shape class kept across calls, CPU tensors left eager in
`auto`, and eager with one warning where nothing can be compiled."""

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_gnmr.platform.compilation import compiled_graphs
from megatron_gnmr.precision import scaling
from megatron_gnmr.precision.formats import FORMATS
from megatron_gnmr.precision.scaling import QuantSpec, quantize
from tests.helpers import LAUNCH_TIMEOUT_S, REPO

SHAPE = (3, 40, 150)  # K = 150: partial tiles (128, 32, 16); 120 rows: partial 128-row blocks


def _input(seed: int, specials: bool, dtype=torch.float32) -> torch.Tensor:
    """Values over 40 binades (every format's normals, subnormals, overflow and underflow),
    with NaN, +-Inf, +-0 and float32 subnormals where `specials`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g) * \
        torch.exp2(torch.randint(-20, 20, SHAPE, generator=g).float())
    if specials:
        x.view(-1)[::997] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"),
                                           float("nan"), 1e-40, -3e-39, 7.0])[
            torch.arange(x.numel())[::997] % 8]
    return x.to(dtype)


def _both(x: torch.Tensor, spec: QuantSpec, seed: int = 5):
    """quantize eagerly and compiled, from the same generator state (NVFP4's stochastic
    rounding draws from it)."""
    results = []
    for mode in ("off", "on"):
        scaling.set_quantizer_compile(mode)
        torch.manual_seed(seed)
        results.append(quantize(x, spec))
    scaling.set_quantizer_compile("auto")
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


SPECS = [QuantSpec(name) for name in FORMATS] + [
    QuantSpec("e4m3", "tensor", pow2_scale=True),
    QuantSpec("e4m3", "row"), QuantSpec("int8", "row"), QuantSpec("int4", "row"),
    QuantSpec("e4m3", "tile"), QuantSpec("e4m3", "tile", pow2_scale=True),
    QuantSpec("e2m3", "tile"), QuantSpec("e4m3", "block"), QuantSpec("e5m2", "block"),
    QuantSpec("e4m3", "mx"), QuantSpec("e2m1", "mx"),
    QuantSpec("e2m1", "nvfp4"), QuantSpec("e2m1", "nvfp4-2d"),
    QuantSpec("e2m1", "nvfp4", stochastic=True)]


def _name(spec: QuantSpec) -> str:
    return "-".join([spec.format, spec.granularity] + ["pow2"] * spec.pow2_scale +
                    ["stochastic"] * spec.stochastic)


@pytest.mark.slow  # one compilation per spec: minutes on a busy 2-core machine
@pytest.mark.parametrize("spec", SPECS, ids=_name)
def test_compiled_quantizer_is_eager_bit_for_bit(spec):
    for seed, specials in ((0, True), (1, False)):
        x = _input(seed, specials)
        eager, compiled = _both(x, spec)
        mismatched = (_bits(eager) != _bits(compiled)).sum().item()
        assert mismatched == 0, f"{mismatched} values differ ({_name(spec)}, seed {seed})"
    assert not torch.equal(eager, x), "the quantizer changed nothing: the test compares nothing"


def test_compiled_e4m3_is_eager_bit_for_bit_in_bf16_and_float32():
    """The fast tier's case: the FP8 recipes' E4M3 per-tensor quantizer, on float32 and bf16
    inputs (the result keeps the input's dtype)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _input(2, True, dtype)
        eager, compiled = _both(x, QuantSpec("e4m3"))
        assert compiled.dtype == dtype
        assert torch.equal(_bits(eager), _bits(compiled))


def test_one_compilation_per_shape_class_kept_across_calls():
    """Another call, another size of the same rank and dtype: no new graph (the compiled
    code is kept across steps and generalises over sizes)."""
    spec = QuantSpec("e5m2", "row")
    scaling.set_quantizer_compile("on")
    try:
        quantize(torch.randn(4, 33, 70), spec)
        before = compiled_graphs()
        for size in (33, 33, 51):
            quantize(torch.randn(4, size, 70), spec)
        assert compiled_graphs() == before
    finally:
        scaling.set_quantizer_compile("auto")


def test_auto_leaves_cpu_tensors_eager_and_modes_are_checked():
    """`auto` compiles large accelerator tensors only: on the CPU compiling measured no
    faster (scripts/bench_speed.py), so a CPU run compiles nothing; `on` compiles."""
    spec = QuantSpec("e3m2")
    before = compiled_graphs()
    quantize(torch.randn(scaling.AUTO_COMPILE_NUMEL * 4), spec)
    assert compiled_graphs() == before
    scaling.set_quantizer_compile("on")
    try:
        quantize(torch.randn(scaling.AUTO_COMPILE_NUMEL), spec)
        assert compiled_graphs() > before
    finally:
        scaling.set_quantizer_compile("auto")
    with pytest.raises(ValueError, match="auto"):
        scaling.set_quantizer_compile("always")


NO_COMPILER = textwrap.dedent("""
    import warnings, torch, torch._inductor.config
    from megatron_gnmr.precision import scaling
    from megatron_gnmr.precision.scaling import QuantSpec, quantize
    from megatron_gnmr.platform.compilation import CompileFallbackWarning, fallback_reason
    torch._inductor.config.cpp.cxx = ("/nonexistent/c++",)  # no C++ compiler
    x = torch.randn(64, 96)
    scaling.set_quantizer_compile("off")
    expected = [quantize(x, QuantSpec(f)) for f in ("e4m3", "int8")]
    scaling.set_quantizer_compile("on")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [quantize(x, QuantSpec(f)) for f in ("e4m3", "int8", "e4m3")]
    said = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "C++ compiler" in str(said[0].message), said[0].message
    assert all(torch.equal(a, b) for a, b in zip(got, expected + expected[:1]))
    print("fell back:", fallback_reason())
""")


def test_without_a_compiler_the_quantizers_run_eager_and_say_so_once():
    result = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True,
                            cwd=REPO, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fell back:" in result.stdout
