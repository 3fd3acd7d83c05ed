"""Megatron-LM's command line, with Megatron-LM's meaning: every flag of its
`pretrain_gpt.py` (the 874 of releases 0.16.1 and 0.19.0, `megatron_lm_flags.json`, read from
its own parser by `scripts/megatron_lm_inventory.py`) is in one of three classes, decided here
and nowhere else:

- works: it means what it means in Megatron-LM and does it (our flag of the same name, or a
  translation to ours);
- family: it states a model choice our model family fixes (`--swiglu`, `--normalization
  RMSNorm`, ...): accepted when it agrees with the run's --model-family, refused naming the
  family's choice when it does not;
- refused: a feature megatron-gnmr does not have, named with what to do instead. Every
  refused flag of a command line is reported in one line, before anything starts.

A Megatron-LM flag is never "unrecognized", and never accepted and ignored. `megatron-gnmr
megatron-flags` prints the table (docs/guide/from-megatron-lm.md holds the explicit part of it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_gnmr.errors import UserError

FAMILIES = ("llama", "deepseek-mla")


@dataclass(frozen=True)
class Rule:
    kind: str
    """works, family or refused."""
    note: str
    """Works: how; family: the family's choice; refused: why, and what to do instead."""
    translate: Callable[[list[str]], list[str]] | None = None
    """works: our flags for the values given (None: our flag of the same name)."""
    agrees: Callable[[list[str], str], bool] | None = None
    """family: whether the values agree with the run's family."""
    unless: Callable[[list[str]], bool] | None = None
    """refused: values that mean "the feature off", accepted (e.g. a parallel size of 1)."""


def same(note: str = "our flag of the same name") -> Rule:
    return Rule("works", note)


def becomes(note: str, translate: Callable[[list[str]], list[str]]) -> Rule:
    return Rule("works", note, translate=translate)


def nothing(note: str) -> Rule:
    """A flag whose Megatron-LM meaning is already what runs here (a deprecated no-op, a
    fusion switched off that we never switch on)."""
    return Rule("works", note, translate=lambda values: [])


def family(choice: str, agrees: Callable[[list[str], str], bool] = lambda v, f: True) -> Rule:
    return Rule("family", choice, agrees=agrees)


def refused(reason: str, unless: Callable[[list[str]], bool] | None = None) -> Rule:
    return Rule("refused", reason, unless=unless)


def _is(*accepted: str) -> Callable[[list[str]], bool]:
    return lambda values: len(values) == 1 and values[0] in accepted


def _one(values: list[str]) -> bool:
    return _is("1")(values)


PERFORMANCE = "same arithmetic: megatron-gnmr never fuses this"
RULES: dict[str, Rule] = {
    # --- the model: what the LLaMA-style families fix -------------------------------------
    "--swiglu": family("SwiGLU MLP (both families)"),
    "--normalization": family("RMSNorm (both families)", lambda v, f: v == ["RMSNorm"]),
    "--position-embedding-type": family("RoPE (both families)", lambda v, f: v == ["rope"]),
    "--use-rotary-position-embeddings": family("RoPE (both families)"),
    "--no-position-embedding": family("no learned position embedding (both families: RoPE)"),
    "--rotary-percent": family("RoPE on the whole head (both families)",
                               lambda v, f: len(v) == 1 and float(v[0]) == 1.0),
    "--untie-embeddings-and-output-weights": family("untied input and output embeddings"),
    "--disable-bias-linear": family("no bias in any linear (both families)"),
    "--add-qkv-bias": family("no QKV bias (both families)", lambda v, f: False),
    "--group-query-attention": family("grouped-query attention (llama; deepseek-mla: latent "
                                      "attention)", lambda v, f: f == "llama"),
    "--qk-layernorm": family("llama: no query/key norm; deepseek-mla: norms on its latents",
                             lambda v, f: f == "deepseek-mla"),
    "--squared-relu": family("SwiGLU MLP (both families)", lambda v, f: False),
    "--openai-gelu": family("SwiGLU MLP (both families)", lambda v, f: False),
    "--multi-latent-attention": becomes("--model-family deepseek-mla (MLA with its latent "
                                        "ranks: --q-lora-rank, --kv-lora-rank, ...)",
                                        lambda v: ["--model-family", "deepseek-mla"]),
    "--apply-layernorm-1p": same("zero-centred gamma: each RMSNorm stores gamma - 1"),
    "--kv-channels": same("each head's width (llama)"),
    "--max-position-embeddings": same("the longest sequence the RoPE tables cover (>= "
                                      "--seq-length; Megatron-LM requires it, absent here: "
                                      "--seq-length)"),
    "--attention-dropout": same("dropout on the attention probabilities"),
    "--hidden-dropout": same("dropout on the residual branches"),
    "--make-vocab-size-divisible-by": same("the embedding padded to a multiple of it x TP"),
    "--num-query-groups": same("sets the key/value heads; Megatron-LM reads it only with "
                               "--group-query-attention, megatron-gnmr always"),
    "--use-mcore-models": nothing("deprecated in Megatron-LM: megatron-core models are the "
                                  "only ones there and here"),
    "--transformer-impl": same("local: megatron-core's local layers; transformer_engine: "
                               "Transformer Engine's (BF16, or FP8 with --fp8-format)"),
    "--rotary-seq-len-interpolation-factor": refused("RoPE position interpolation is not "
                                                     "built; drop it"),
    "--use-rope-scaling": same("Llama 3.1's RoPE frequency scaling (megatron-core's: the low "
                               "frequencies slowed by --rope-scaling-factor, Llama 3's bands; "
                               "llama family)"),
    "--rope-scaling-factor": same("--use-rope-scaling's factor (Llama 3.1: 8, Llama 3.2: 32)"),
    # --- the optimizer and the schedule ---------------------------------------------------
    "--optimizer": refused("megatron-gnmr trains with Adam(W) only; drop it or give adam",
                           unless=_is("adam")),
    "--train-samples": same("sample-based length; the schedule counts samples"),
    "--lr-decay-style": same("megatron-core's OptimizerParamScheduler"),
    "--lr-warmup-init": same(), "--lr-decay-iters": same(), "--lr-decay-samples": same(),
    "--lr-warmup-iters": same(), "--lr-warmup-samples": same(),
    "--lr-warmup-fraction": same(), "--lr-wsd-decay-style": same(),
    "--lr-wsd-decay-iters": same(), "--lr-wsd-decay-samples": same(),
    "--start-weight-decay": same(), "--end-weight-decay": same(),
    "--weight-decay-incr-style": same(), "--adam-eps": same(),
    "--decoupled-lr": same("the input and output embeddings' own peak LR (megatron-core's "
                           "optimizer)"),
    "--decoupled-min-lr": same("their own final LR"),
    "--fp16": refused("fp16 training (dynamic loss scaling) is not supported; use --bf16"),
    "--rampup-batch-size": refused("batch-size ramp-up is not supported (the data position "
                                   "assumes one global batch); drop it"),
    "--grad-reduce-in-bf16": same("data-parallel gradient reduction in bf16 (else fp32)"),
    "--accumulate-allreduce-grads-in-fp32": nothing("gradients are reduced in fp32 here "
                                                    "already (unless --grad-reduce-in-bf16)"),
    "--cross-entropy-loss-fusion": same("megatron-core's fused cross entropy ('native')"),
    "--calculate-per-token-loss": same("the loss averaged over every token of the step, not "
                                       "per micro-batch"),
    # --- precision -------------------------------------------------------------------------
    "--fp8-format": same("FP8 on, as in Megatron-LM: through Transformer Engine (te-fp8; "
                         "refused where TE cannot run, naming the emulated recipe); with "
                         "--precision-recipe it picks that recipe's format"),
    "--fp8-recipe": same("tensorwise, blockwise, mxfp8 (delayed scaling is refused)"),
    "--fp8-amax-history-len": refused("delayed scaling's history: megatron-gnmr scales FP8 by "
                                      "the current amax (--fp8-recipe tensorwise/blockwise/"
                                      "mxfp8); drop it", unless=_one),
    "--fp8-amax-compute-algo": refused("delayed scaling's reduction: drop it (current "
                                       "scaling)", unless=_is("most_recent")),
    "--fp8-margin": refused("delayed scaling's margin: drop it", unless=_is("0")),
    "--fp8-param-gather": refused("FP8 master weights are not supported (the controller "
                                  "switches a unit's GEMMs, not its stored weights); drop it"),
    "--first-last-layers-bf16": same(), "--num-layers-at-start-in-bf16": same(),
    "--num-layers-at-end-in-bf16": same(),
    # --- fusions and kernels: ours are unfused, so turning one off changes nothing ---------
    "--no-masked-softmax-fusion": nothing(PERFORMANCE),
    "--no-bias-swiglu-fusion": nothing(PERFORMANCE),
    "--no-bias-gelu-fusion": nothing(PERFORMANCE),
    "--no-bias-dropout-fusion": nothing(PERFORMANCE),
    "--no-rope-fusion": nothing(PERFORMANCE),
    "--no-persist-layer-norm": nothing(PERFORMANCE),
    "--no-gradient-accumulation-fusion": same(),
    "--attention-backend": same("flash, fused, unfused: Transformer Engine's kernels with "
                                "its layers; with local layers torch's SDPA runs (megatron's "
                                "own attention for local and unfused; a notice says so). "
                                "megatron-core writes NVTE_FLASH_ATTN/NVTE_FUSED_ATTN/"
                                "NVTE_UNFUSED_ATTN for the backend and refuses a value "
                                "already in the environment that disagrees: a launch "
                                "finding one is refused in one line naming it"),
    "--use-flash-attn": same(),
    "--recompute-activations": becomes("--recompute-granularity selective",
                                       lambda v: ["--recompute-granularity", "selective"]),
    # --- parallelism --------------------------------------------------------------------------
    "--context-parallel-size": refused("context parallelism is not supported; use 1 (split "
                                       "long sequences with TP and --sequence-parallel)",
                                       unless=_one),
    "--num-layers-per-virtual-pipeline-stage": refused(
        "the interleaved (virtual) pipeline schedule is not supported; drop it (1F1B)"),
    "--num-virtual-stages-per-pipeline-rank": refused(
        "the interleaved (virtual) pipeline schedule is not supported; drop it (1F1B)",
        unless=_one),
    "--expert-tensor-parallel-size": refused("experts split over TP like the dense layers "
                                             "only; drop it", unless=_one),
    "--moe-grouped-gemm": refused("one GEMM per expert here, so one expert can switch "
                                  "precision alone; drop it"),
    "--moe-token-dispatcher-type": refused("the all-to-all dispatcher only; give alltoall",
                                           unless=_is("alltoall")),
    "--moe-layer-freq": becomes("--moe-first-dense-layers (the [0]*N+[1]*M pattern)",
                                lambda v: ["--moe-first-dense-layers", str(_dense_prefix(v))]),
    # --- data and tokenizers -------------------------------------------------------------
    "--data-path": same("one prefix, weight-prefix pairs, or prefixes weighted by size"),
    "--train-data-path": same(), "--valid-data-path": same(), "--test-data-path": same(),
    "--data-args-path": same(), "--per-split-data-args-path": same(),
    "--split": same("train, valid and test weights of the documents"),
    "--mock-data": same(), "--data-cache-path": same(), "--tokenizer-type": same(),
    "--tokenizer-model": same(), "--vocab-file": same(), "--merge-file": same(),
    "--vocab-size": same("NullTokenizer's vocabulary (and prepare-data's BPE)"),
    "--no-mmap-bin-files": same(),
    "--no-create-attention-mask-in-dataloader": nothing("megatron-gnmr never builds attention "
                                                        "masks (causal attention)"),
    "--num-workers": same("threads that read the next step's samples ahead"),
    "--tiktoken-pattern": nothing("read by TikTokenizer only, in Megatron-LM too (TikTokenizer"
                                  " itself is refused)"),
    "--legacy-tokenizer": refused("Megatron-LM's old tokenizers are not offered; drop it (the "
                                  "default ones: data/tokenizers.py)"),
    # --- logging and housekeeping -------------------------------------------------------
    "--log-throughput": same("TFLOP/s per device by Megatron-LM's formula"),
    "--manual-gc": same(), "--manual-gc-interval": same(),
    "--empty-unused-memory-level": same("frees the accelerator's cached memory after each step "
                                        "(1) and evaluation (2); nothing to free on a CPU"),
    "--profile": same("torch.profiler over --profile-step-start..end, traced to the run "
                      "directory (Megatron-LM's --use-pytorch-profiler)"),
    "--use-pytorch-profiler": same(), "--profile-step-start": same(),
    "--profile-step-end": same(),
    "--exit-duration-in-mins": same("checkpoint and exit 0 once the run has lasted this long"),
    "--log-validation-ppl-to-tensorboard": nothing("validation perplexity is always logged"),
    "--no-check-for-nan-in-loss-and-grad": nothing(
        "a NaN or Inf in the loss or gradients is never applied here and costs no extra "
        "synchronisation to find: the step is skipped and reported, and the run stops after "
        "--gnmr-max-nonfinite-steps such steps in a row (Megatron-LM's check would raise)"),
    "--moe-permute-fusion": nothing(PERFORMANCE),
    "--moe-router-force-load-balancing": refused("a benchmarking switch: it routes every "
                                                 "token at random; drop it"),
    "--moe-flex-dispatcher-backend": refused("DeepEP/HybridEP (GPU kernels of the flex "
                                             "dispatcher): the all-to-all dispatcher only; "
                                             "drop it"),
    "--mtp-num-layers": refused("multi-token prediction (DeepSeek-V3's MTP modules) is not "
                                "built here; drop it", unless=lambda v: v in (["0"], [])),
    "--mtp-loss-scaling-factor": refused("multi-token prediction is not built here; drop it"),
    "--recompute-modules": refused("selective recompute here recomputes megatron-core's "
                                   "default module, the core attention; drop it"),
    "--dist-ckpt-strictness": refused("a load here is strict (every tensor the model needs "
                                      "from the checkpoint, none unexpected); drop it"),
    "--log-timers-to-tensorboard": refused("timers are not logged here (step time and "
                                           "tokens/s are, at every step); drop it"),
    "--log-memory-to-tensorboard": refused("memory is not logged here (estimate-memory "
                                           "gives it before a launch); drop it"),
    "--enable-experimental": refused("megatron-core's experimental features are not used "
                                     "here; drop it"),
    "--auto-detect-ckpt-format": nothing("a checkpoint's format is always read off the "
                                         "checkpoint at a load (torch_dist or torch)"),
    # --- checkpoints beyond --ckpt-format / --no-load-optim / --no-load-rng ---------------
    "--use-dist-ckpt": nothing("torch_dist is the default --ckpt-format"),
    "--ckpt-fully-parallel-save": nothing("torch_dist's save is always fully parallel here "
                                          "(each tensor written once, the writing spread over "
                                          "the data-parallel replicas)"),
    "--dist-ckpt-optim-fully-reshardable": same("the distributed optimizer saved fully "
                                                "reshardable (TP, PP, EP may change at a "
                                                "resume); without it DP-reshardable, as "
                                                "Megatron-LM"),
    "--distrib-optim-fully-reshardable-mem-efficient": same("the fully reshardable save "
                                                            "gathered to DP rank 0 alone"),
    "--ckpt-fully-parallel-load": same("each data-parallel replica reads a share and they "
                                       "exchange the rest"),
    "--async-save": same("megatron-core's async save (a forked writer per save; published, "
                         "hashed and complete, once every rank has written)"),
    "--use-persistent-ckpt-worker": nothing("--async-save forks a writer per save (the "
                                            "persistent worker is CUDA-only)"),
}


def _dense_prefix(values: list[str]) -> int:
    """--moe-layer-freq's [0]*N+[1]*M (or 1): N dense layers first, the rest MoE."""
    text = "".join(values).replace(" ", "")
    if text in ("1", "[1]"):
        return 0
    if text.startswith("[0]*") and "+[1]*" in text:
        head = text[len("[0]*"):text.index("+[1]*")]
        if head.isdigit():
            return int(head)
    raise UserError(f"--moe-layer-freq {' '.join(values)}: only 1 or [0]*N+[1]*M (N dense "
                    "layers first, as DeepSeek's) is supported")


@functools.lru_cache(maxsize=None)
def inventory() -> dict[str, dict]:
    """Megatron-LM's flags: name -> {nargs, takes_value, choices, default, releases}."""
    return json.loads(Path(__file__).with_name("megatron_lm_flags.json").read_text())


def rule_of(flag: str, our_flags: frozenset[str]) -> Rule | None:
    """The flag's class (None: not a Megatron-LM flag); a flag that works and whose default
    here is not Megatron-LM's says so (`megatron_defaults.DIFFERENCES`)."""
    from megatron_gnmr.interop.megatron_defaults import difference_note

    rule = RULES.get(flag) or (same() if flag in our_flags else None)
    if rule is not None:
        differs = difference_note(flag)
        if differs:
            return dataclasses.replace(rule, note=f"{rule.note}; {differs}")
        if rule.kind == "works" and rule.note == same().note:
            return dataclasses.replace(rule, note=f"{rule.note} and Megatron-LM's default")
        return rule
    if flag in inventory():
        return refused("a Megatron-LM feature megatron-gnmr does not have; drop it")
    return None


@dataclass
class Translation:
    """A command line in our flags, and what to check or say once the config is known."""

    argv: list[str]
    family_checks: list[tuple[str, list[str], Rule]]
    translated: list[tuple[str, list[str], list[str]]]


def _values(argv: list[str], at: int, spec: dict) -> tuple[list[str], int]:
    """The values of the Megatron-LM flag at `argv[at]` (or after `=`), and where the next
    argument starts, by the flag's arity in Megatron-LM's parser."""
    token = argv[at]
    if "=" in token:
        return [token.split("=", 1)[1]], at + 1
    nargs = spec["nargs"] if spec else None
    rest = argv[at + 1:]
    if nargs == 0:
        return [], at + 1
    if nargs in (None, 1):
        if not rest:
            raise UserError(f"{token}: expects a value")
        return [rest[0]], at + 2
    if isinstance(nargs, int):
        if len(rest) < nargs:
            raise UserError(f"{token}: expects {nargs} values")
        return rest[:nargs], at + 1 + nargs
    taken = []
    for word in rest:
        if word.startswith("--"):
            break
        taken.append(word)
        if nargs == "?":
            break
    return taken, at + 1 + len(taken)


def translate(argv: list[str], our_flags: frozenset[str]) -> Translation:
    """Our command line for `argv` (which may mix our flags and Megatron-LM's). Every refused
    Megatron-LM flag is reported in one UserError."""
    out, checks, translated, refusals = [], [], [], []
    at = 0
    while at < len(argv):
        token = argv[at]
        flag = token.split("=", 1)[0]
        rule = rule_of(flag, our_flags) if flag.startswith("--") else None
        if rule is None or (rule.kind == "works" and rule.translate is None):
            out.append(token)
            at += 1
            continue
        values, at = _values(argv, at, inventory().get(flag))
        if rule.kind == "refused":
            if rule.unless is None or not rule.unless(values):
                shown = " ".join([flag, *values])
                refusals.append(f"{shown} ({rule.note})")
            continue
        if rule.kind == "family":
            checks.append((flag, values, rule))
            continue
        ours = rule.translate(values)
        translated.append((flag, values, ours))
        out.extend(ours)
    if refusals:
        raise UserError("Megatron-LM flags megatron-gnmr does not have: " + "; ".join(refusals))
    return Translation(out, checks, translated)


def check_family(translation: Translation, model_family: str) -> None:
    """The family flags against the run's family (one line naming the disagreements)."""
    wrong = [f"{' '.join([flag, *values])} (the {model_family} family fixes {rule.note})"
             for flag, values, rule in translation.family_checks
             if not rule.agrees(values, model_family)]
    if wrong:
        raise UserError("model choices --model-family " + model_family + " does not make: "
                        + "; ".join(wrong))
