"""Issue 58 item 6: the MoE combinations that cannot run (`--lora` with `--num-experts`, MoE at
TP > 1 without `--sequence-parallel`) are refused while the flags are read, in one line naming
the flag, by `parse_config` itself: before validation, distributed start-up or a model, and
in every command that reads a run's flags (estimate-memory too). On the old code the parse
accepted both and a later check refused them.
(`tests/test_bad_input.py`'s `lora_with_experts` holds the launch's one line and exit 2.)"""

import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]


def test_lora_with_experts_is_refused_by_the_parser():
    with pytest.raises(UserError, match="--lora with --num-experts") as caught:
        parse_config(["--lora", *MOE], announce=False)
    assert "\n" not in str(caught.value)
    parse_config(["--lora"], announce=False)  # dense LoRA and full MoE fine-tunes parse
    parse_config(MOE, announce=False)


def test_moe_at_tp2_without_sequence_parallel_is_refused_by_the_parser():
    with pytest.raises(UserError, match="needs --sequence-parallel"):
        parse_config([*MOE, *TP2], world_size=2, announce=False)
    config = parse_config([*MOE, *TP2, "--sequence-parallel"], world_size=2, announce=False)
    assert config.parallel.sequence_parallel
    parse_config(TP2, world_size=2, announce=False)  # a dense model at TP 2 needs no SP

