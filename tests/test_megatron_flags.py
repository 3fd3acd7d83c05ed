"""Megatron-LM's command line as one table: every flag of its parser has exactly one class,
the flags that work are ours (so none is "unrecognized"), refusals come all in one line, a
flag's values are taken by Megatron-LM's arity, and family choices are checked against the
run's family."""

import pytest

from megatron_gnmr.arguments import build_parser, parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.interop.megatron_flags import RULES, inventory, rule_of

OURS = frozenset(n for action in build_parser()._actions for n in action.option_strings)


def test_every_megatron_lm_flag_has_a_class_and_works_means_ours():
    assert len(inventory()) > 800
    classes = {flag: rule_of(flag, OURS).kind for flag in inventory()}
    assert set(classes.values()) == {"works", "family", "refused"}
    for flag, rule in RULES.items():
        assert flag in inventory(), f"{flag} is not a Megatron-LM flag"
        if rule.kind == "works" and rule.translate is None:
            assert flag in OURS, f"{flag} works as our flag of the same name, which is missing"
    # the flags the issue names as everyday ones all work or state a family choice
    for flag in ("--swiglu", "--normalization", "--position-embedding-type",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                 "--group-query-attention", "--lr-decay-style", "--lr-decay-iters",
                 "--train-samples", "--adam-beta1", "--adam-beta2", "--adam-eps",
                 "--max-position-embeddings", "--tokenizer-type", "--data-cache-path",
                 "--recompute-activations", "--exit-duration-in-mins"):
        assert classes[flag] in ("works", "family"), flag


def test_refused_flags_are_named_together_with_their_values_and_reasons():
    with pytest.raises(UserError) as caught:
        parse_config(["--context-parallel-size", "4", "--num-layers", "2",
                      "--num-layers-per-virtual-pipeline-stage", "1", "--fp16",
                      "--moe-grouped-gemm"])
    message = str(caught.value)
    assert "\n" not in message
    for shown in ("--context-parallel-size 4", "--num-layers-per-virtual-pipeline-stage 1",
                  "--fp16", "--moe-grouped-gemm"):
        assert shown in message
    assert "--num-layers" not in message.replace("--num-layers-per", "")


# Every refused flag with values that mean "the feature off": (flag, a neutral value, a value
# that turns the feature on), written out from what each feature is (Megatron-LM's parser).
NEUTRAL_AND_ON = [
    ("--optimizer", "adam", "sgd"),
    ("--fp8-amax-history-len", "1", "1024"),
    ("--fp8-amax-compute-algo", "most_recent", "max"),
    ("--fp8-margin", "0", "1"),
    ("--context-parallel-size", "1", "2"),
    ("--num-virtual-stages-per-pipeline-rank", "1", "2"),
    ("--expert-tensor-parallel-size", "1", "2"),
    ("--moe-token-dispatcher-type", "alltoall", "allgather"),
    ("--mtp-num-layers", "0", "1"),
]


def test_neutral_values_of_a_missing_feature_are_accepted():
    """Each neutral value is accepted and the value beside it, the feature on, is refused
    naming it: a rule whose `unless` accepted everything would pass a test of neutral values
    alone. The pairs cover every rule with an `unless`."""
    config = parse_config(["--context-parallel-size", "1", "--optimizer", "adam",
                           "--moe-token-dispatcher-type", "alltoall", "--use-mcore-models"])
    assert config.model.num_layers == 2
    assert {flag for flag, _, _ in NEUTRAL_AND_ON} == \
        {flag for flag, rule in RULES.items() if rule.unless is not None}
    refused_neutral, accepted_on = [], []
    for flag, neutral, on in NEUTRAL_AND_ON:
        try:
            parse_config([flag, neutral])
        except UserError:
            refused_neutral.append(f"{flag} {neutral}")
        try:
            parse_config([flag, on])
        except UserError as error:
            assert f"{flag} {on} (" in str(error), error
        else:
            accepted_on.append(f"{flag} {on}")
    assert refused_neutral == []
    assert accepted_on == []


def test_values_are_taken_by_megatron_lms_arity():
    """A refused flag with nargs '*' takes every value up to the next flag; one that takes
    one value takes one; `--flag=value` is one token."""
    with pytest.raises(UserError) as caught:
        parse_config(["--tokenizer-special-tokens", "<a>", "<b>", "--lr", "1e-3"])
    assert "--tokenizer-special-tokens <a> <b>" in str(caught.value)
    config = parse_config(["--recompute-activations", "--lr-decay-style=linear",
                           "--lr", "1e-3"])
    assert config.training.recompute_granularity == "selective"
    assert config.training.lr_decay_style == "linear" and config.training.lr == 1e-3


@pytest.mark.parametrize("flags, family, agrees", [
    (["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
      "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--rotary-percent",
      "1.0", "--group-query-attention"], "llama", True),
    (["--normalization", "LayerNorm"], "llama", False),
    (["--position-embedding-type", "learned_absolute"], "llama", False),
    (["--rotary-percent", "0.5"], "llama", False),
    (["--group-query-attention"], "deepseek-mla", False),
    (["--qk-layernorm"], "deepseek-mla", True),
    (["--qk-layernorm"], "llama", False),
])
def test_family_choices_against_the_family(flags, family, agrees):
    args = [*flags, "--model-family", family]
    if agrees:
        assert parse_config(args).model.model_family == family
    else:
        with pytest.raises(UserError) as caught:
            parse_config(args)
        assert f"--model-family {family}" in str(caught.value)


def test_fp8_format_keeps_megatron_lms_meaning():
    """Alone it is FP8 through Transformer Engine; with a recipe it picks the format; a
    recipe's format defaults to hybrid."""
    assert parse_config(["--fp8-format", "hybrid"]).precision.precision_recipe == "te-fp8"
    emulated = parse_config(["--precision-recipe", "fp8-emulated", "--fp8-format", "e4m3"])
    assert emulated.precision.precision_recipe == "fp8-emulated"
    from megatron_gnmr.precision.backends import build_recipe

    assert build_recipe(emulated.precision).low.grad.format == "e4m3"
    default = parse_config(["--precision-recipe", "fp8-emulated"]).precision
    assert build_recipe(default).low.grad.format == "e5m2"
    assert parse_config([]).precision.precision_recipe == "none"
    assert parse_config(["--transformer-impl", "transformer_engine"]) \
        .precision.precision_recipe == "te"


def test_the_command_prints_the_table():
    from megatron_gnmr.flag_table import table

    text = table(["--swiglu", "--fp16", "--lr", "--not-a-flag"])
    assert "| `--swiglu` | family choice |" in text and "| `--fp16` | refused |" in text
    assert "| `--lr` | works |" in text and "not a Megatron-LM flag" in text
