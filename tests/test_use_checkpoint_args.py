"""Megatron-LM's --use-checkpoint-args: a fine-tune of a checkpoint that does not restate its
shape takes every model setting from the checkpoint, and a flag that disagrees is refused in
one line naming both."""

import json

from tests.helpers import TINY, pretrain_in_process

SHAPE = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
         "--num-query-groups")


def _without_shape(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in SHAPE:
            skip = True
            continue
        out.append(arg)
    return out


def test_the_model_comes_from_the_checkpoint_and_a_disagreeing_flag_is_refused(tmp_path, capfd):
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert pretrain_in_process([*TINY, "--num-layers", "3", "--train-iters", "3",
                                "--eval-interval", "3", "--save", str(base)]) == 0
    rest = [*_without_shape(TINY), "--train-iters", "3", "--eval-interval", "3",
            "--finetune", "--load", str(base), "--use-checkpoint-args"]
    capfd.readouterr()
    assert pretrain_in_process([*rest, "--hidden-size", "96", "--save", str(tuned)]) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--hidden-size 96 disagrees with" in error[0] and \
        "--hidden-size 64" in error[0], error
    assert not tuned.exists()
    assert pretrain_in_process([*rest, "--save", str(tuned)]) == 0
    model = json.loads((tuned / "config.json").read_text())["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_query_groups"]) == (3, 64, 2)
