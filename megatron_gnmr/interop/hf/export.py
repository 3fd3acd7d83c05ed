"""`megatron-gnmr export-hf RUN_DIR OUT_DIR`: a trained run as a Hugging Face model directory
that `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` load with no extra code, through its model family's
mapping (`family.hf`; the llama family's writes Llama, or Mixtral for a MoE run).

The run's newest intact checkpoint is read in this one process: a torch_dist checkpoint (the
default format) is resharded to one rank whatever layout wrote it (TP, PP, DP, distributed
optimizer, expert parallelism); a torch-format one must come from a one-process run. Every
family has a mapping (llama's writes Llama or Mixtral, deepseek-mla's DeepseekV3); a family
added without one, or a setting the mapping's classes cannot express, is refused by name; a
LoRA run is exported as a PEFT adapter (`--adapter`, `peft_adapter.py`) or merged first
(merge-lora). The weights go through the mapping's `to_hf` into `model.safetensors` in
the run's own dtype (its checkpoint's: float32 for an fp32 run or an import, bfloat16 for a
--bf16 run; `--dtype` converts), beside `config.json`, `generation_config.json` and the
tokenizer (a SentencePiece model as `tokenizer.model` read by transformers' SentencePiece
backend, which encodes exactly as we do; a Hugging Face tokenizer's own files; GPT-2's vocab
and merges). Everything is written into `OUT_DIR.partial` and renamed when complete: a
failed export leaves nothing that looks like a model. The embedding keeps Megatron's padded
rows (config.json's vocab_size says so; the tokenizer never produces them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families import hf_mapping

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def source_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a run's weights are held in (the widest floating one, should they differ):
    what an export writes unless --dtype says otherwise, so nothing is rounded unasked."""
    held = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return max(held, key=lambda dtype: torch.finfo(dtype).bits, default=torch.float32)


def _check_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export-hf: {out} exists and is not empty; give a new directory")


@contextlib.contextmanager
def model_on_one_rank(run_dir: Path):
    """Within: (config, model chunks, tokenizer, checkpoint directory) of a run, its weights
    loaded in this one process (a world of one)."""
    from megatron_gnmr.checkpoints import per_rank
    from megatron_gnmr.checkpoints.choice import choose
    from megatron_gnmr.data.datasets import tokenizer_of
    from megatron_gnmr.evaluation.loaded_run import run_config, unsplit
    from megatron_gnmr.model import build_model
    from megatron_gnmr.training import distributed

    config = run_config(run_dir)
    hf_mapping(config, f"export-hf {run_dir}")
    if config.lora.enabled:
        raise UserError(f"export-hf {run_dir}: a LoRA run; export its adapters with --adapter "
                        "(a PEFT adapter directory over the exported base), or merge them "
                        "(megatron-gnmr merge-lora) and export the merged run")
    unsplit(config)
    distributed.initialize(config)
    try:
        tokenizer = tokenizer_of(config.data)
        model = build_model(config, tokenizer.vocab_size, for_training=False)
        choice = choose(str(run_dir))
        if choice.format.reshards:  # resharded to this one process, whatever wrote it
            from megatron_gnmr.checkpoints.torch_dist import run

            run.load_model_weights(model, choice.directory, f"export-hf {run_dir}")
        else:
            meta = per_rank.read_meta(choice.directory)
            if meta.get("world_size") != 1:
                raise UserError(f"export-hf {run_dir}: its checkpoint is in the torch format, "
                                f"written by {meta.get('world_size')} processes; resume it for "
                                "no step with --ckpt-format torch_dist (reshardable) and export "
                                "that")
            from megatron_gnmr.training.resume import load_model_state

            load_model_state(model[0], per_rank.load_shard(choice.directory)["model"][0])
        for chunk in model:
            chunk.eval()
        yield config, model, tokenizer, choice.directory
    finally:
        distributed.shutdown()


def load_weights_on_one_rank(run_dir: Path):
    """(config, full state dict of the model, tokenizer, checkpoint) of a run."""
    from megatron_gnmr.model import unwrap

    with model_on_one_rank(run_dir) as (config, model, tokenizer, source):
        state = {k: v.detach().clone() for k, v in unwrap(model[0]).state_dict().items()
                 if not k.endswith("_extra_state")}
        return config, state, tokenizer, source


def logits_of(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The run's logits [batch, seq, padded vocab] for `tokens` [batch, seq], float32."""
    from megatron_gnmr.model import unwrap
    from megatron_gnmr.platform.device import run_device

    with model_on_one_rank(run_dir) as (_, model, _, _), torch.no_grad():
        tokens = tokens.to(run_device())  # the model's device
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) \
            .expand_as(tokens)
        return unwrap(model[0])(tokens, positions, None).float().cpu()


def write_tokenizer(tokenizer, out: Path) -> None:
    """The run's tokenizer in a form AutoTokenizer reads."""
    from megatron_gnmr.data import tokenizers

    if isinstance(tokenizer, tokenizers.GPTSentencePiece):
        shutil.copyfile(tokenizer.model_path, out / "tokenizer.model")
        piece = tokenizer._sp.id_to_piece
        # transformers' SentencePiece backend encodes with the model itself (its Llama
        # tokenizer converts it to a BPE that splits our whitespace differently)
        config = {"tokenizer_class": "SentencePieceBackend", "add_bos_token": False,
                  "add_eos_token": False, "legacy": True, "clean_up_tokenization_spaces": False,
                  "eos_token": piece(tokenizer.eod), "unk_token": piece(tokenizer._sp.unk_id())}
        if tokenizer.bos >= 0:
            config["bos_token"] = piece(tokenizer.bos)
        if tokenizer.pad >= 0:
            config["pad_token"] = piece(tokenizer.pad)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    elif isinstance(tokenizer, (tokenizers.HuggingFace, tokenizers.GPT2BPE)):
        for file in tokenizer.files:
            shutil.copyfile(file, out / file.name)
        if isinstance(tokenizer, tokenizers.GPT2BPE):
            (out / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
                 "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, indent=2))
    else:
        raise UserError(f"export-hf: a {tokenizer.kind} has no Hugging Face form")


def export(run_dir: str, out_dir: str, dtype: str | None = None, adapter: bool = False,
           base_model: str | None = None) -> Path:
    """`dtype` None: the run's own (`source_dtype`)."""
    from safetensors.torch import save_file

    from megatron_gnmr.model import padded_vocab_size

    run, out = Path(run_dir), Path(out_dir)
    _check_target(out)
    if adapter:
        from megatron_gnmr.interop.hf.peft_adapter import export_adapter

        return export_adapter(run, out, DTYPES.get(dtype), base_model)
    config, state, tokenizer, source = load_weights_on_one_rank(run)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    hf_map = hf_mapping(config, f"export-hf {run}")
    to = DTYPES[dtype] if dtype else source_dtype(state)
    weights = {k: v.to(to) for k, v in hf_map.to_hf(state, config).items()}
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_map.hf_config(config, padded_vocab_size(tokenizer.vocab_size, config), tokenizer,
                          DTYPE_NAMES[to])
    (partial / "config.json").write_text(json.dumps(hf, indent=2))
    (partial / "generation_config.json").write_text(json.dumps(
        {key: hf[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
         if hf[key] is not None}, indent=2))
    write_tokenizer(tokenizer, partial)
    (partial / "megatron_gnmr_source.json").write_text(json.dumps(
        {"run": str(run.resolve()), "checkpoint": str(source)}, indent=2))
    if out.exists():
        out.rmdir()  # empty (checked above)
    partial.replace(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (--save of a LLaMA-family run)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write (new)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the weights' dtype (default: the run's own, float32 for an fp32 "
                        "run or an import, bfloat16 for a --bf16 run; adapters too)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter directory "
                        "(peft.PeftModel.from_pretrained(base, OUT_DIR)); the base is "
                        "exported from the run it fine-tuned")
    parser.add_argument("--base-model", default=None, metavar="NAME_OR_PATH",
                        help="with --adapter: the base model's Hugging Face directory or hub "
                        "name, recorded in adapter_config.json")


def run(args: argparse.Namespace) -> None:
    if args.base_model is not None and not args.adapter:
        raise UserError("export-hf --base-model: only with --adapter")
    path = export(args.run_dir, args.out_dir, args.dtype, args.adapter, args.base_model)
    if args.adapter:
        print(f"export-hf: {path} (peft.PeftModel.from_pretrained(base, {str(path)!r}))")
    else:
        print(f"export-hf: {path} (transformers.AutoModelForCausalLM.from_pretrained)")
