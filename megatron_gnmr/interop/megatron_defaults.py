"""What an absent Megatron-LM flag means here: Megatron-LM's default, read from its own parser
at the tag we pin (`megatron_lm_defaults.json`, written by `scripts/megatron_lm_inventory.py
--defaults` from `megatron/training/arguments.py`), except the flags below, each with why.

A copied `pretrain_gpt.py` command line means what it means in Megatron-LM: every flag it
leaves out takes Megatron-LM's default (`tests/test_megatron_defaults.py` holds each of our
defaults equal to the table). Where ours differs, `megatron-flags` says so in the flag's row,
and a launch that leaves such a flag out says so once at its start (`start_notice.py`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REQUIRED = "Megatron-LM has no default (a launch without it fails there)"


def _always(config) -> bool:
    return True


@dataclass(frozen=True)
class Difference:
    reason: str
    """Why ours differs, and what to give for Megatron-LM's meaning."""
    matters: Callable = _always
    """Whether the difference changes this run (its config), so the start notice names it."""
    here: str | None = None
    """What the absent flag means here, in words, for a Megatron-LM flag that is not ours by
    name (a family choice, a refused feature's setting): the start notice shows it."""
    megatron_lm: str | None = None
    """Megatron-LM's default in words where its parser's value does not say it (a None that
    `validate_args` fills in, a switch's meaning); None: the parser's value."""


def _moe(config) -> bool:
    return bool(config.model.num_experts)


DIFFERENCES: dict[str, Difference] = {
    # Megatron-LM cannot run without these: ours make a tiny CPU model train as it is
    "--num-layers": Difference(REQUIRED),
    "--hidden-size": Difference(REQUIRED),
    "--num-attention-heads": Difference(REQUIRED),
    "--seq-length": Difference(REQUIRED),
    "--micro-batch-size": Difference(REQUIRED),
    "--lr": Difference(REQUIRED),
    "--train-iters": Difference(REQUIRED + " (or --train-samples); here: 100 steps"),
    "--eval-interval": Difference(REQUIRED + "; here: every 50 steps and at the end"),
    "--save-interval": Difference("Megatron-LM requires it with --save; here 0: a checkpoint at "
                                  "the end only", lambda c: c.checkpoint.save is not None),
    "--vocab-size": Difference("Megatron-LM's NullTokenizer requires it; here also the size of "
                               "the tokenizer prepare-data trains",
                               lambda c: c.data.tokenizer_type == "NullTokenizer",
                               megatron_lm="requires it"),
    # the same meaning, another spelling of it
    "--num-query-groups": Difference("the same meaning: absent, one key/value head per query "
                                     "head in both", lambda c: False),
    "--exit-interval": Difference("the same meaning: 0 here, None there (never)",
                                  lambda c: False),
    # where megatron-gnmr differs on purpose
    "--attention-dropout": Difference("0 here (LLaMA trains without dropout; the recorded "
                                      "scenarios rely on it): give --attention-dropout 0.1 for "
                                      "Megatron-LM's"),
    "--hidden-dropout": Difference("0 here (LLaMA trains without dropout; the recorded scenarios "
                                   "rely on it): give --hidden-dropout 0.1 for Megatron-LM's"),
    "--split": Difference("95,5,0 here (Megatron-LM fills in 969,30,1 with a warning; the "
                          "recorded scenarios rely on ours): give --split 969,30,1 for "
                          "Megatron-LM's", megatron_lm="969,30,1"),
    "--untie-embeddings-and-output-weights": Difference(
        "untied here (LLaMA's layout; Megatron-LM ties them unless the flag is given): give "
        "--no-untie-embeddings-and-output-weights for Megatron-LM's", megatron_lm="tied"),
    "--transformer-impl": Difference("local here (megatron-core's local layers, which run "
                                     "without Transformer Engine and whose GEMMs the "
                                     "controller switches): give --transformer-impl "
                                     "transformer_engine for Megatron-LM's"),
    "--fp8-recipe": Difference("tensorwise here: delayed scaling (Megatron-LM's default) is "
                               "not built", lambda c: c.precision.fp8_format is not None),
    "--moe-router-dtype": Difference("fp32 here (Megatron-LM: the model's dtype): the router "
                                     "is never a unit, so no recipe reaches it", _moe,
                                     megatron_lm="the model's dtype"),
    # the architecture our families fix (Megatron-LM's defaults build GPT-2's): a LLaMA script
    # gives these flags, and they are accepted as the family's choice
    "--swiglu": Difference("SwiGLU here (both families fix it; Megatron-LM's default MLP is "
                           "GELU): a LLaMA script gives --swiglu", here="--swiglu: SwiGLU",
                           megatron_lm="GELU"),
    "--normalization": Difference("RMSNorm here (both families fix it): a LLaMA script gives "
                                  "--normalization RMSNorm", here="--normalization RMSNorm",
                                  megatron_lm="LayerNorm"),
    "--position-embedding-type": Difference("rope here (both families fix it; Megatron-LM "
                                            "adds learned absolute positions): a LLaMA script "
                                            "gives --position-embedding-type rope",
                                            here="--position-embedding-type rope",
                                            megatron_lm="learned_absolute"),
    "--disable-bias-linear": Difference("no biases here (both families fix it; Megatron-LM "
                                        "adds them): a LLaMA script gives "
                                        "--disable-bias-linear",
                                        here="--disable-bias-linear: no biases",
                                        megatron_lm="biases"),
    "--qk-layernorm": Difference("deepseek-mla normalises its latents whenever it has a query "
                                 "latent (--q-lora-rank), as DeepSeek-V2/V3 do: a V3 script "
                                 "gives --qk-layernorm",
                                 lambda c: c.model.model_family == "deepseek-mla" and
                                 c.mla.q_lora_rank is not None,
                                 here="--qk-layernorm: the latents normalised",
                                 megatron_lm="qk_layernorm=False"),
    # where megatron-gnmr lacks Megatron-LM's default feature, and runs its alternative
    "--moe-token-dispatcher-type": Difference("alltoall here: the all-gather dispatcher (its "
                                              "default) is not offered; the routing and the "
                                              "sums are the same", _moe,
                                              here="--moe-token-dispatcher-type alltoall",
                                              megatron_lm="allgather"),
    "--dist-ckpt-strictness": Difference("strict here (Megatron-LM's default accepts "
                                         "unexpected keys)",
                                         lambda c: c.checkpoint.load is not None,
                                         here="--dist-ckpt-strictness: strict",
                                         megatron_lm="assume_ok_unexpected"),
    "--no-check-for-nan-in-loss-and-grad": Difference(
        "a NaN or Inf step is skipped and reported here (Megatron-LM's check raises at the "
        "first)", here="a NaN or Inf step: skipped and reported",
        megatron_lm="--check-for-nan-in-loss-and-grad raises"),
    "--no-gradient-accumulation-fusion": Difference(
        "off here unless asked (--gradient-accumulation-fusion; Megatron-LM fuses where apex or "
        "TE has the kernel): the emulated and switchable GEMMs compute their own weight "
        "gradient", lambda c: c.training.bf16, megatron_lm="fused"),
}

# Megatron-LM flags whose parser default is None and whose meaning `validate_args` fills in
# (core_v0.16.1's `megatron/training/arguments.py`): we apply the same rule.
FILLED_IN = {
    "--ffn-hidden-size": "with --swiglu: 8/3 x --hidden-size rounded down to a multiple of 64",
    "--global-batch-size": "--micro-batch-size x the data-parallel size",
    "--kv-channels": "--hidden-size / --num-attention-heads",
}


@functools.lru_cache(maxsize=None)
def megatron_lm_defaults() -> dict:
    """Megatron-LM's parser at the pinned tag: {megatron_lm, source, flags: {flag: {dest,
    default, action, given}}}."""
    return json.loads(Path(__file__).with_name("megatron_lm_defaults.json").read_text())


def difference_note(flag: str) -> str | None:
    """`megatron-flags`: the flag's default here against Megatron-LM's (None: the same)."""
    difference = DIFFERENCES.get(flag)
    if difference is None:
        return None
    return f"default differs from Megatron-LM's ({theirs(flag)}): {difference.reason}"


def theirs(flag: str) -> str:
    """Megatron-LM's default of `flag` in words: a switch's as the setting it stores."""
    difference = DIFFERENCES.get(flag)
    if difference is not None and difference.megatron_lm is not None:
        return difference.megatron_lm
    if difference is not None and difference.reason.startswith(REQUIRED):
        return "requires it"
    entry = megatron_lm_defaults()["flags"][flag]
    if entry["action"] in ("store_true", "store_false"):
        return f"{entry['dest']}={entry['default']}"
    return str(entry["default"])
