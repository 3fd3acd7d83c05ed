"""The CPU patches: each call site fails without its patch and works with it.

If a megatron-core upgrade removes a CUDA-only call site, the "still needed" half fails
and tells us to delete that patch; if a call site changes shape, the "works" half fails.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_gnmr.platform import capabilities
from tests.helpers import LAUNCH_TIMEOUT_S

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patches")

UNPATCHED_PROBE = textwrap.dedent("""
    import json, torch
    results = {}
    def probe(name, fn):
        try:
            fn(); results[name] = "works"
        except Exception as error:
            results[name] = type(error).__name__
    probe("cuda_literal", lambda: torch.zeros(2, device="cuda"))
    probe("current_device", torch.cuda.current_device)
    probe("cuda_rng_state", torch.cuda.get_rng_state)
    probe("tensor_type", lambda: torch.zeros(1).type() == "torch.cuda.FloatTensor" or 1 / 0)
    def seed():
        from megatron.core import parallel_state, tensor_parallel
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1)
    probe("megatron_seed", seed)
    print(json.dumps(results))
""")


def test_each_patched_call_site_fails_without_the_patch():
    out = subprocess.run([sys.executable, "-c", UNPATCHED_PROBE], capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT_S)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(status != "works" for status in results.values()), results


# The patches change torch and megatron process-wide: they are exercised in a process of
# their own, never in the test runner's.
PATCHED_PROBE = textwrap.dedent("""
    import json, torch
    from megatron_gnmr.platform import apply_cpu_patches
    assert apply_cpu_patches() is True
    assert apply_cpu_patches() is True  # idempotent
    checks = {}
    def check(name, fn):
        try:
            checks[name] = bool(fn())
        except Exception as error:
            checks[name] = f"{type(error).__name__}: {error}"

    check("cuda_literal", lambda: torch.zeros(2, device="cuda").device.type == "cpu")
    check("to_cuda", lambda: torch.ones(1).to("cuda").device.type == "cpu")
    check("dot_cuda", lambda: torch.ones(1).cuda().device.type == "cpu")
    check("cuda_index", lambda: torch.zeros(1, device=0).device.type == "cpu")
    check("current_device", lambda: torch.cuda.current_device() == "cpu")
    check("float_type_name", lambda: torch.zeros(1).type() == "torch.cuda.FloatTensor")
    check("bf16_type_name", lambda: torch.zeros(1, dtype=torch.bfloat16).type()
          == "torch.cuda.BFloat16Tensor")
    def streams():
        torch.cuda.synchronize()
        torch.cuda.Stream().wait_stream(torch.cuda.current_stream())
        return True
    check("streams", streams)

    def rng_tracker():
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel import random as mrandom
        mrandom.initialize_rng_tracker(force_reset=True)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.add("a", 11)
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with tracker.fork("a"):
            inside = torch.rand(3)
        untouched = torch.equal(torch.get_rng_state(), before)  # default stream untouched
        torch.manual_seed(11)
        seeded = torch.equal(inside, torch.rand(3))  # the fork draws from seed 11
        with tracker.fork("a"):
            advances = not torch.equal(torch.rand(3), inside)  # and its state advances
        return untouched and seeded and advances
    check("rng_tracker_forks_cpu_states", rng_tracker)

    print(json.dumps(checks))
""")


def test_each_patch_works_in_a_process_of_its_own():
    out = subprocess.run([sys.executable, "-c", PATCHED_PROBE], capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    checks = json.loads(out.stdout.strip().splitlines()[-1])
    assert checks and all(value is True for value in checks.values()), checks


def test_capabilities_explain_why_not():
    te = capabilities.transformer_engine()
    assert not te and "CUDA" in te.reason
    assert not capabilities.cuda() and capabilities.cuda().reason
