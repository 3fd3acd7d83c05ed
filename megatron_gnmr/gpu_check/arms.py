"""gpu_check's arms: trainers built from one seed, their layers compiled on request, stepped
side by side in rotating order (drift hits every arm alike), and the step component's
per-step work timed with CUDA-synchronised timers.

Compilation is each transformer layer's forward through `torch.compile`, whole, the same for
every arm of a group, so FP8 and BF16 are compared under the same compilation. (`--compile`,
training/layer_compile.py, cuts each unit linear out as a region of its own so that the
controller's switching recompiles nothing; the check times the layers whole, the form
torchao's float8 speed-ups are documented with.) It is an instance attribute
over the layer's `forward`, so `eager()` can lift it for the steps whose units' inputs are
captured by hooks.
"""

from __future__ import annotations

import contextlib
import time

import torch


def synchronize() -> None:
    """Wait for the device: a step or a timer ends when its kernels end, not at return."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def build_trainers(flags: dict[str, list[str]]) -> dict:
    """A Trainer per arm (pretrain flags), each built from the run's seed."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.platform import attention_environment
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer

    configs = {name: parse_config(arm) for name, arm in flags.items()}
    distributed.initialize(next(iter(configs.values())))
    trainers = {}
    for name, config in configs.items():
        attention_environment.forget()  # each arm decides its own, as a launch would
        distributed.set_seeds(config.training.seed)
        trainers[name] = Trainer(config)
    return trainers


def transformer_layers(trainer) -> list[torch.nn.Module]:
    from megatron_gnmr.model import unwrap

    return [layer for chunk in trainer.model for layer in unwrap(chunk).decoder.layers]


class CompiledLayers:
    """Layers (every transformer layer of a group's trainers) compiled with one backend."""

    def __init__(self, layers: list[torch.nn.Module], backend: str):
        import torch._dynamo.config as dynamo

        # Two arms' layers, two layers each, and the controller's switches: more variants of
        # one forward than dynamo's default limit (8), past which it runs eager silently.
        name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, name, max(getattr(dynamo, name), 64))
        self.layers = list(layers)
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)

    @contextlib.contextmanager
    def eager(self):
        """The layers run their own (eager) forward inside."""
        compiled = [layer.__dict__.pop("forward") for layer in self.layers]
        try:
            yield
        finally:
            for layer, forward in zip(self.layers, compiled):
                layer.forward = forward


class Stepper:
    """Steps a group's trainers, each at its own next step."""

    def __init__(self, trainers: dict):
        self.trainers = trainers
        self.next_step = dict.fromkeys(trainers, 0)

    def step(self, name: str) -> tuple[float, float]:
        """(seconds, loss) of `name`'s next training step. The emulated quantizers' compile
        mode is process-wide: each trainer's own is set before its step."""
        from megatron_gnmr.precision.scaling import set_quantizer_compile

        set_quantizer_compile(self.trainers[name].config.training.quantizer_compile)
        synchronize()
        start = time.perf_counter()
        metrics = self.trainers[name].train_step(self.next_step[name])
        synchronize()
        self.next_step[name] += 1
        return time.perf_counter() - start, metrics["train/loss"]

    def side_by_side(self, names: list[str], steps: int, warmup: int):
        """Train `names` in rotating order: (seconds of each measured step, every loss) per
        arm; the first `warmup` steps (compilation, allocation) are not measured."""
        seconds = {name: [] for name in names}
        losses = {name: [] for name in names}
        for index in range(warmup + steps):
            turn = index % len(names)
            for name in names[turn:] + names[:turn]:
                took, loss = self.step(name)
                if index >= warmup:
                    seconds[name].append(took)
                losses[name].append(loss)
        return seconds, losses


class WorkTimer:
    """Times a step component's per-step work (`after_backward` and `decide`, which the
    trainer calls once each per step) with the device synchronised at both ends, so what it
    queued counts and what came before it does not. Instance attributes over the methods;
    `remove()` lifts them."""

    METHODS = ("after_backward", "decide")

    def __init__(self, component):
        self.component = component
        self.seconds: list[float] = []  # per step
        self._this_step = 0.0
        for name in self.METHODS:
            setattr(component, name, self._timed(getattr(component, name), name == "decide"))

    def _timed(self, method, ends_step: bool):
        def timed(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                synchronize()
                self._this_step += time.perf_counter() - start
                if ends_step:
                    self.seconds.append(self._this_step)
                    self._this_step = 0.0
        return timed

    def remove(self) -> None:
        for name in self.METHODS:
            delattr(self.component, name)


def time_step_work(stepper: Stepper, names: list[str], steps: int) -> dict[str, list[float]]:
    """The per-step work of each arm's step component (its controller, or PlainStep), over
    `steps` steps trained side by side."""
    timers = {name: WorkTimer(stepper.trainers[name].controller) for name in names}
    try:
        stepper.side_by_side(names, steps, warmup=0)
    finally:
        for timer in timers.values():
            timer.remove()
    return {name: timer.seconds for name, timer in timers.items()}
