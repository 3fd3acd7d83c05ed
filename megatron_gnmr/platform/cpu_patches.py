"""Make megatron-core run on a machine without CUDA.

megatron-core assumes CUDA in a handful of places. Every workaround lives here, each
commented with the call site it serves (megatron-core 0.16.1 and 0.19.x), applied once,
and only when CUDA is absent: on a GPU machine this module does nothing.

`tests/test_cpu_patches.py` fails if a patch stops working (the call site raises again) so a
megatron upgrade that changes a call site is noticed, not silently papered over.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_gnmr.platform import device_audit

_APPLIED = False
_DEVICE_MODE: TorchFunctionMode | None = None


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if type(device) is int:  # a CUDA index, e.g. `device=torch.cuda.current_device()`
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` to CPU for every torch call made while it is active.

    Call sites: literal `device="cuda"` / `torch.cuda.current_device()` in
    `pipeline_parallel/schedules.py` (token counts), `transformer/attention.py` and
    `utils.get_default_causal_mask` (mask when `attention_mask=None`),
    `optimizer/clip_grads.py` (norm accumulators), `optimizer/optimizer.py` (found_inf),
    `distributed/param_and_grad_buffer.py`. Also answers `Tensor.type()` with the CUDA type
    name, since `clip_grads.py:167` asserts `'torch.cuda.FloatTensor'` and
    `Float16OptimizerWithFloat16Params.__init__` accepts only `torch.cuda.*Tensor` params.
    Cost: about 1.6 us per torch call, CPU runs only.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_cpu_device(kwargs["device"]))
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(): the tensor stays where it is.
            return args[0]
        if name == "to":
            args = tuple(_cpu_device(a) for a in args)
        result = func(*args, **kwargs)
        if name == "type" and len(args) == 1 and not kwargs and isinstance(result, str):
            if result.startswith("torch.") and ".cuda." not in result:
                return result.replace("torch.", "torch.cuda.", 1)
        return result


class _NoStream:
    """Stands in for `torch.cuda.Stream`/`Event` (MoE alltoall dispatcher, p2p comms)."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *args):
        pass

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def wait_event(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True


def _patch_cuda_runtime(audit: bool) -> None:
    # `torch.cuda.current_device()`: RoPE (`rotary_pos_embedding.py`), the global memory
    # buffer (`utils.GlobalMemoryBuffer`), DDP buffers, pipeline p2p, MoE token dispatch.
    # Under the device audit it answers a CUDA index, as on a GPU (turned into CPU tensors
    # by `CudaToCpuMode`, but counted as device tensors by the audit), except where no
    # torch-function mode is active to do that: the autograd engine runs backward without
    # the modes (megatron's all-to-all backward allocates with this device).
    index = device_audit.audited_index()

    def current_device():
        return index if audit and torch._C._len_torch_function_stack() > 0 else "cpu"

    torch.cuda.current_device = current_device
    # `torch.cuda.synchronize()`: pipeline `p2p_communication.py` after batched isend/irecv.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # `torch.cuda.Stream()` / `current_stream()`: MoE alltoall dispatcher, p2p comms.
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


def _patch_rng_tracker() -> None:
    """`tensor_parallel.random.model_parallel_cuda_manual_seed` keeps CUDA generator states
    (`torch.cuda.get_rng_state()` asserts without CUDA) and `get_cuda_rng_tracker().fork()`
    is entered by core attention dropout and weight init. Keep CPU generator states instead,
    with the same names and seeds, so TP ranks still draw different dropout masks."""
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # `torch.cuda.manual_seed` in model_parallel_cuda_manual_seed: CPU seeding is done by
    # the caller (training.distributed.set_seeds), so this becomes a no-op.
    torch.cuda.manual_seed = lambda *args, **kwargs: None
    # Activation recompute (`CheckpointFunction`) saves and restores the CUDA RNG state.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _patch_recompute() -> None:
    """Activation recompute re-runs forward code inside the backward of megatron's
    `CheckpointFunction` / `CheckpointWithoutOutputFunction` (`tensor_parallel/random.py`),
    where the autograd engine has no torch-function mode active: the causal mask's
    `device="cuda"` (`utils.get_default_causal_mask`) would reach CUDA. Run those backwards
    under the CPU rewrite too."""
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("CheckpointFunction", "CheckpointWithoutOutputFunction"):
        function = getattr(mrandom, name, None)
        if function is None:
            continue
        original = function.backward

        def backward(ctx, *args, _original=original):
            with CudaToCpuMode():
                return _original(ctx, *args)

        function.backward = staticmethod(backward)


def _patch_moe() -> None:
    """MoE call sites (imported lazily: MoE modules are heavy)."""
    from megatron.core.transformer.moe import token_dispatcher

    # Alltoall dispatcher with EP > 1: split sizes stay tensors on CPU (`maybe_move_tensor_
    # to_cpu` only converts CUDA tensors) and gloo's `all_to_all_single` rejects tensors.
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def apply_cpu_patches() -> bool:
    """Apply every patch once if CUDA is absent. Returns True when patches are active."""
    global _APPLIED, _DEVICE_MODE
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    audit = device_audit.active()
    _patch_cuda_runtime(audit)
    _patch_rng_tracker()
    _patch_recompute()
    _patch_moe()
    _DEVICE_MODE = CudaToCpuMode()
    _DEVICE_MODE.__enter__()
    if audit:  # entered last, so it sees each call before the CPU rewrite
        device_audit.install()
    _APPLIED = True
    return True
