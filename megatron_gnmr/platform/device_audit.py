"""The device audit: prove on a CPU-only machine that a run follows the device rule.

On a GPU, every tensor that enters an NCCL collective must live on the GPU and the optimizer
must hold GPU parameters; on a CPU machine every tensor is a CPU tensor, so a plain CPU run
cannot tell a tensor placed by the rule from one that forgot it. Under the audit
(`MEGATRON_GNMR_DEVICE_AUDIT=<report prefix>`, CPU only) the rule names a CUDA device
(`cuda:LOCAL_RANK`) and megatron's `torch.cuda.current_device()` answers that index, exactly
as on a GPU; the CPU patches turn those requests into CPU tensors as usual, and this mode
marks every tensor that a request for the HOST made:

- a factory call (`torch.zeros`, `torch.tensor`, ...) with no device or a CPU device,
  `torch.from_numpy`, `.cpu()`, `.to("cpu")`;
- anything computed from host tensors alone (an op that also reads a non-host tensor runs
  where that tensor lives, as CUDA ops do with 0-dim CPU operands).

`x.device` of a device tensor answers the audited CUDA device, so `device=x.device` follows
x as it does on a GPU.

A marked tensor entering a collective, or held by an optimizer when it steps, is what NCCL
or megatron's optimizer would refuse on a GPU: it is recorded with its call site, and each
rank writes `<prefix>.rank<R>.json` at exit. So is what works on a CPU and breaks on a GPU
the other way round:
- a host tensor (not 0-dim, not an index) in an op with device tensors: CUDA refuses the mix;
- a device tensor in an object collective (`all_gather_object`, ...): it is pickled with its
  device and comes back on the sender's GPU (or fails to load where that index is absent);
- a device tensor written by `torch.save` (a checkpoint file restores it onto the saving
  rank's GPU index) and a `torch.load` without `map_location` (a file that holds one). State restored from a checkpoint never passes
through the rule (it is read to the host, `map_location="cpu"`): every tensor a shard holds is
marked host as it is read (`mark_restored`), and after a resume every tensor of the live state
it was restored into (model, optimizer, monitors, controller) must have left the host
(`check_restored`). Tensors the mode never saw (autograd's
gradients) count as device tensors: on a GPU they follow the tensors they derive from.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

ENVIRONMENT = "MEGATRON_GNMR_DEVICE_AUDIT"
_MARK = "_megatron_gnmr_on_host"
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list")
# ops that take host tensors beside device ones on a GPU too: indexing with host indices, a
# copy between devices
CROSS_DEVICE_OPS = ("__getitem__", "__setitem__", "index_put_", "index_put", "copy_")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "all_to_all",
               "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def active() -> bool:
    return bool(os.environ.get(ENVIRONMENT)) and not torch.cuda.is_available()


def audited_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


AUDITED_DEVICE = torch.device("cuda", audited_index())
_DEVICE_DESCRIPTOR = torch.Tensor.device


def on_host(tensor) -> bool:
    return bool(getattr(tensor, _MARK, False))


def _set_mark(tensor, host: bool) -> None:
    try:
        setattr(tensor, _MARK, host)
    except (AttributeError, RuntimeError):
        pass


def _names_host(device) -> bool | None:
    """True for a CPU device, False for an accelerator, None for no device given."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type == "cpu"
    if isinstance(device, str):
        return device.startswith("cpu")
    if type(device) is int:
        return False
    return None


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _outputs(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return []


class HostTensorMarks(TorchFunctionMode):
    """Marks host tensors as they are made; see the module docstring for the rules."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE_DESCRIPTOR:  # `device=x.device`: as x
            return result if on_host(args[0]) else AUDITED_DEVICE
        host = self._host_result(func, args, kwargs)
        if host and args and result is args[0] and not on_host(result) and \
                getattr(func, "__name__", "") in ("cpu", "to"):
            result = result.clone()  # on a GPU a copy moves to the host; the original stays
        if host is not None:
            for output in _outputs(result):
                if not (output is (args[0] if args else None) and _in_place(func)):
                    _set_mark(output, host)
        return result

    @staticmethod
    def _host_result(func, args, kwargs) -> bool | None:
        name = getattr(func, "__name__", "")
        requested = _names_host(kwargs.get("device"))
        if name == "cpu":
            return True
        if name == "cuda":
            return False
        if name == "to" and len(args) > 1:
            if isinstance(args[1], torch.Tensor):
                return on_host(args[1])
            requested = _names_host(args[1]) if requested is None else requested
        if requested is not None:
            return requested
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        if not inputs:  # a factory without a device: the host
            return True
        hosts = [on_host(t) for t in inputs]
        if any(hosts) and not all(hosts) and _AUDIT is not None and name not in CROSS_DEVICE_OPS and \
                any(h and t.dim() > 0 for h, t in zip(hosts, inputs)):
            _AUDIT.record(f"host tensor mixed with device tensors in {name}")
        return all(hosts)


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


class DeviceAudit:
    def __init__(self, report_prefix: str):
        self.report_prefix = report_prefix
        self.violations: list[dict] = []
        self.checked = {"collective_tensors": 0, "optimizer_parameters": 0,
                        "restored_tensors": 0, "objects": 0}

    def record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-3]
                  if "torch/" not in f.filename and "device_audit" not in f.filename]
        ours = [f for f in frames if "megatron_gnmr" in f.filename]
        site = frames[-1] if frames else None
        entry = {"what": what,
                 "call_site": f"{site.filename}:{site.lineno}" if site else "?",
                 "our_caller": f"{ours[-1].filename}:{ours[-1].lineno}" if ours else None}
        if entry not in self.violations:
            self.violations.append(entry)

    def check_collective(self, name: str, values) -> None:
        for tensor in _tensors(values):
            self.checked["collective_tensors"] += 1
            if on_host(tensor):
                self.record(f"host tensor {tuple(tensor.shape)} {tensor.dtype} in "
                            f"torch.distributed.{name}")

    def check_optimizer(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.checked["optimizer_parameters"] += 1
                if on_host(param):
                    self.record(f"host parameter {tuple(param.shape)} in "
                                f"{type(optimizer).__name__}.step")

    def check_object(self, what: str, tree) -> None:
        """A pickled object (object collectives, torch.save) must hold host tensors only."""
        self.checked["objects"] += 1
        for tensor in _tree_tensors(tree):
            if not on_host(tensor):
                self.record(f"device tensor {tuple(tensor.shape)} {tensor.dtype} in {what}")

    def check_restored(self, what: str, state) -> None:
        for tensor in _tree_tensors(state):
            self.checked["restored_tensors"] += 1
            # a 0-dim tensor may stay on the host (CUDA ops take 0-dim CPU operands; torch
            # keeps Adam's `step` there on a GPU too)
            if on_host(tensor) and tensor.dim() > 0:
                self.record(f"host tensor {tuple(tensor.shape)} {tensor.dtype} restored into "
                            f"{what}")

    def write_report(self) -> None:
        rank = os.environ.get("RANK", "0")
        path = f"{self.report_prefix}.rank{rank}.json"
        with open(path, "w") as file:
            json.dump({"violations": self.violations, "checked": self.checked}, file, indent=2)


def _wrap_collective(audit: DeviceAudit, name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        values = [*args, *kwargs.values()]
        if name == "batch_isend_irecv":
            values = [op.tensor for op in args[0]]
        audit.check_collective(name, values)
        return original(*args, **kwargs)

    return collective


def _wrap_object_collective(audit: DeviceAudit, name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        # the object is the second argument of all_gather_object / gather_object, the first
        # of the list forms (which are also what is received)
        sent = args[1] if name in ("all_gather_object", "gather_object") and len(args) > 1 \
            else (args[0] if args else kwargs.get("object_list", kwargs.get("obj")))
        audit.check_object(f"torch.distributed.{name}", sent)
        result = original(*args, **kwargs)
        # what arrives was unpickled, unseen by the mode: host tensors, as they were sent
        # (a device tensor sent is recorded above)
        for received in (*args[:1], *kwargs.values()):
            for tensor in _tree_tensors(received):
                _set_mark(tensor, True)
        return result

    return collective


def _mark_from_numpy() -> None:
    """`torch.from_numpy` does not pass through the mode: its tensors are host tensors."""
    original = torch.from_numpy

    @functools.wraps(original)
    def from_numpy(array):
        tensor = original(array)
        _set_mark(tensor, True)
        return tensor

    torch.from_numpy = from_numpy


def _inside_object_collective() -> bool:
    """Whether torch.save/load was called by pickle on torch's behalf: a tensor's storage is
    pickled through them (torch/storage.py), for object collectives (checked on their own)."""
    caller = sys._getframe(2).f_code.co_filename
    return caller.endswith((f"torch{os.sep}storage.py", "distributed_c10d.py"))


def _wrap_save_and_load(audit: DeviceAudit) -> None:
    save, load = torch.save, torch.load

    @functools.wraps(save)
    def audited_save(obj, *args, **kwargs):
        if not _inside_object_collective():
            audit.check_object("torch.save", obj)
        return save(obj, *args, **kwargs)

    @functools.wraps(load)
    def audited_load(*args, **kwargs):
        if kwargs.get("map_location") is None and len(args) < 2 and \
                not _inside_object_collective():
            audit.record("torch.load without map_location")
        return load(*args, **kwargs)

    torch.save, torch.load = audited_save, audited_load


def _mark_new_parameters() -> None:
    """`nn.Parameter(data)` makes a new tensor object that the mode never sees: give it the
    mark of its data (megatron's CPU initialisation wraps host tensors this way)."""
    original = torch.nn.Parameter.__new__

    def new(cls, data=None, requires_grad=True):
        parameter = original(cls, data, requires_grad)
        _set_mark(parameter, data is None or on_host(data))
        return parameter

    torch.nn.Parameter.__new__ = staticmethod(new)


def _tree_tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif hasattr(tree, "__dataclass_fields__"):
        yield from _tree_tensors(vars(tree))
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tree_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tree_tensors(value)


_AUDIT: DeviceAudit | None = None


def mark_restored(tree) -> None:
    """Under the audit: every tensor of a shard just read from disk (to the host) is marked."""
    if _AUDIT is not None:
        for tensor in _tree_tensors(tree):
            _set_mark(tensor, True)


def check_restored(what: str, state) -> None:
    """Under the audit: no tensor of `state` (restored from a checkpoint) is on the host."""
    if _AUDIT is not None:
        _AUDIT.check_restored(what, state)


def install() -> DeviceAudit:
    """Enter the marking mode, wrap the collectives and hook every optimizer step. Called by
    `apply_cpu_patches` after the CPU device mode, so this mode sees each call first."""
    global _AUDIT
    audit = _AUDIT = DeviceAudit(os.environ[ENVIRONMENT])
    from torch.distributed import distributed_c10d

    for name in COLLECTIVES:
        wrapped = _wrap_collective(audit, name, getattr(distributed_c10d, name))
        torch.distributed.__dict__[name] = wrapped
        # `P2POp` checks its op against distributed_c10d's own isend/irecv. Other c10d
        # functions stay: object collectives call them on host tensors by design.
        if name in ("isend", "irecv"):
            setattr(distributed_c10d, name, wrapped)
    for name in OBJECT_COLLECTIVES:
        torch.distributed.__dict__[name] = _wrap_object_collective(
            audit, name, getattr(distributed_c10d, name))
    _wrap_save_and_load(audit)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(audit.check_optimizer)
    _mark_new_parameters()
    _mark_from_numpy()
    HostTensorMarks().__enter__()
    atexit.register(audit.write_report)
    return audit
