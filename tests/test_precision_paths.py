"""Paths inside a real megatron GPTModel (one process): exact recovery, locality of a
switch, and a backward that always follows its forward's path."""

import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller.units import UnitShape, local_unit_modules
from megatron_gnmr.model import bind_precision, build_gpt_model, transformer_config
from megatron_gnmr.precision.plan import PrecisionPlan
from tests.helpers import TINY

UNITS = [f"layers.{layer}.{name}" for layer in range(2) for name in (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
    "mlp.linear_fc2")]


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from megatron_gnmr.training import distributed

    config = parse_config(TINY)
    distributed.initialize(config)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _model(recipe: str, plan: PrecisionPlan | None = None):
    from megatron_gnmr.training.distributed import set_seeds

    config = parse_config([*TINY, "--precision-recipe", recipe])
    set_seeds(7)  # identical initial weights for every model built here
    model = build_gpt_model(config, transformer_config(config), vocab_size=512)
    if plan is not None:
        bind_precision(local_unit_modules([model], UnitShape(num_layers=2)), config, plan)
    return model


def _batch():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (2, 64), generator=generator)
    return tokens, torch.arange(64).expand(2, 64), torch.roll(tokens, -1, dims=1)


def _run(model):
    """Per-unit (input, output) of the forward, the loss, and every parameter gradient."""
    captured = {}
    hooks = [model.get_submodule(f"decoder.{name}").register_forward_hook(
        lambda module, args, out, name=name: captured.__setitem__(
            name, (args[0].detach().clone(), out[0].detach().clone())))
        for name in UNITS]
    tokens, positions, labels = _batch()
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return captured, loss.detach(), grads


SWITCHED_RECIPES = ["fp8-emulated", "fp8-torchao"]


@pytest.mark.parametrize("recipe", SWITCHED_RECIPES)
def test_recovery_path_is_the_unquantized_module_bitwise(megatron_world, recipe):
    reference = _run(_model("none"))
    recovered = _run(_model(recipe, PrecisionPlan(all_recovery=True)))
    assert torch.equal(recovered[1], reference[1])
    for name, grad in reference[2].items():
        assert torch.equal(recovered[2][name], grad), name
    low = _run(_model(recipe, PrecisionPlan()))
    assert not torch.equal(low[1], reference[1])  # the low-cost path really quantizes


@pytest.mark.parametrize("recipe", SWITCHED_RECIPES)
def test_switching_one_unit_changes_only_that_unit(megatron_world, recipe):
    switched = "layers.1.self_attention.linear_proj"
    everything = _run(_model(recipe, PrecisionPlan(all_recovery=True)))
    one_low = PrecisionPlan(recovery=frozenset(set(UNITS) - {switched}))
    partly = _run(_model(recipe, one_low))
    for name in UNITS:
        x, y = partly[0][name]
        if name == switched:
            assert not torch.equal(y, everything[0][name][1])
            continue
        # every other unit computes exactly its high-precision linear of what it received
        weight = _model("none").get_submodule(f"decoder.{name}").weight
        assert torch.equal(y, torch.matmul(x, weight.t()))
        if UNITS.index(name) < UNITS.index(switched):  # upstream: untouched altogether
            assert torch.equal(y, everything[0][name][1])


def test_backward_follows_the_forward_path_when_the_plan_changes_mid_step(megatron_world):
    def loss_and_grads(change_plan_before_backward: bool):
        plan = PrecisionPlan()
        model = _model("fp8-emulated", plan)
        tokens, positions, labels = _batch()
        loss = model(tokens, positions, None, labels=labels).mean()
        if change_plan_before_backward:
            plan.advance(UNITS, step=2)  # a decision arriving too early must not leak in
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    steady, changed = loss_and_grads(False), loss_and_grads(True)
    for name in steady:
        assert torch.equal(steady[name], changed[name]), name
