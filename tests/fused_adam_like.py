"""An optimizer that looks, to a checkpoint's save and load, like Transformer Engine's FusedAdam
(megatron's optimizer wherever TE imports: every NGC container), for CPU tests of what a GPU
cluster's resume meets.

What it copies of TE 2.9 to HEAD (`transformer_engine/pytorch/optimizers/fused_adam.py`):
the step count lives in the parameter groups (`group["step"]`), never in a parameter's state;
`state_dict` and `load_state_dict` map every per-parameter state entry through
`name_to_dtype_map` (`get_unscaled_state` / `set_scaled_state`), which knows `exp_avg`,
`exp_avg_sq` and `master_param` only: a `step` there is a KeyError, as in TE. The update is
AdamW's (adam_w_mode) in float32, so a run is deterministic and a resume can be compared bit
for bit with the uninterrupted run.
"""

from __future__ import annotations

import contextlib

import torch


class FusedAdamLike(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, **unused):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            correction1 = 1 - beta1 ** group["step"]
            correction2 = 1 - beta2 ** group["step"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                if self.adam_w_mode:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad,
                                                         value=1 - beta2)
                denominator = (state["exp_avg_sq"] / correction2).sqrt().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / correction1)

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]  # TE: no entry for `step`
        return self.state[param][state_name].to(dtype)

    def set_scaled_state(self, param, state_name, unscaled_state):
        dtype = self.name_to_dtype_map[state_name]
        self.state[param][state_name] = unscaled_state.to(dtype).clone()

    def state_dict(self):
        unscaled = {param: {name: self.get_unscaled_state(param, name) for name in state}
                    for param, state in self.state.items()}
        kept, self.state = self.state, unscaled
        try:
            return super().state_dict()
        finally:
            self.state = kept

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for param, state in list(self.state.items()):
            for name, value in list(state.items()):
                self.set_scaled_state(param, name, value)


@contextlib.contextmanager
def megatron_builds_fused_adam(monkeypatch):
    """Within: megatron-core builds its Adam as it does where TE imports."""
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(optimizer, "Adam", FusedAdamLike)
    monkeypatch.setattr(optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    monkeypatch.setattr(distrib_optimizer, "Adam", FusedAdamLike)  # its isinstance check
    yield
