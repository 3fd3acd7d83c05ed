"""`megatron-gnmr import-hf HF_DIR OUT_DIR`: a Hugging Face model (any family's mapping) as a
checkpoint that `--finetune --load OUT_DIR` (and `--lora`) and `evaluate` accept, in any
layout (a torch_dist checkpoint, resharded on load).

The model settings are read from config.json (a setting its family cannot build is refused
by name); the weights from safetensors only (a `pytorch_model.bin` is a pickle, which could
run code: refused; `directory.py`); every field read is checked against its range and every
tensor on disk against the shape those fields give it, both ways (the family mapping's
`expected_weights`, `model_families/checked_hf.py`), before anything is written; the tokenizer
(tokenizer.json: a Hugging Face tokenizer; tokenizer.model alone: SentencePiece) travels into
OUT_DIR/tokenizer, and its vocabulary must fit the embedding. OUT_DIR holds the checkpoint
(`iter_0000000`), `config.json` (a run's, so evaluate reads it) and `model.yaml`, the model
and tokenizer flags to fine-tune it with (`--config OUT_DIR/model.yaml`). Written into
`OUT_DIR.partial` and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

from megatron_gnmr.errors import UserError
from megatron_gnmr.interop.hf.directory import read_hf
from megatron_gnmr.model_families import family_reading
from megatron_gnmr.model_families.checked_hf import check_weights
from megatron_gnmr.model_families.tied_hf import check_tied_weights



def read_tokenizer(hf_dir: Path):
    """The tokenizer built as a run will build it, from the files where they are (an error
    names them): (type, the files that travel with it, its model's name, the tokenizer)."""
    from megatron_gnmr.data.tokenizers import GPTSentencePiece, HuggingFace

    if (hf_dir / "tokenizer.json").is_file():
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        return HuggingFace.kind, names, "", HuggingFace(hf_dir, flag="import-hf")
    if (hf_dir / "tokenizer.model").is_file():
        return GPTSentencePiece.kind, ("tokenizer.model",), "tokenizer.model", \
            GPTSentencePiece(hf_dir / "tokenizer.model", flag="import-hf")
    raise UserError(f"import-hf {hf_dir}: no tokenizer.json or tokenizer.model (the "
                    "tokenizer travels with the model)")


def _check_shapes(ours: dict, live: dict, where: str) -> None:
    for name, tensor in ours.items():
        if name not in live:
            raise UserError(f"{where}: {name} is not a weight of the model config.json "
                            "describes")
        if tuple(tensor.shape) != tuple(live[name].shape):
            raise UserError(f"{where}: {name} has shape {tuple(tensor.shape)}, config.json "
                            f"makes it {tuple(live[name].shape)}")


def import_hf(hf_dir: str, out_dir: str) -> Path:
    from megatron_gnmr.config import RunConfig
    from megatron_gnmr.model import build_model, unwrap
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.resume_contract import resume_settings
    from megatron_gnmr.checkpoints.torch_dist.run import save_weights
    from megatron_gnmr.training.run_state import RunState

    source, out = Path(hf_dir), Path(out_dir)
    where = f"import-hf {source}"
    if not source.is_dir():
        raise UserError(f"{where}: not a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"import-hf: {out} exists and is not empty; give a new directory")
    hf, weights, files = read_hf(source)
    family = family_reading(hf, where)
    sections = family.hf.sections(hf, where)
    check_tied_weights(weights, hf, where)
    unused = family.hf.unused_weights(weights, hf)
    check_weights(family.hf.expected_weights(sections, hf), weights, files, where,
                  sections["model"]["num_layers"], unused)
    if unused:
        print(f"import-hf: left out {len(unused)} weights transformers' "
              f"{type(family.hf).__name__.removesuffix('HF')} does not use either "
              f"({unused[0]}, ...)")
        weights = {k: v for k, v in weights.items() if k not in unused}
    kind, tokenizer_files, tokenizer_model, tokenizer = read_tokenizer(source)
    rows = weights["model.embed_tokens.weight"].shape[0]  # checked: config.json's vocab_size
    if tokenizer.vocab_size > rows:
        raise UserError(f"{where}: the tokenizer ({', '.join(p.name for p in tokenizer.files)}) "
                        f"has {tokenizer.vocab_size} tokens, config.json's vocab_size (the "
                        f"embedding's rows) {rows}; they do not belong together")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "tokenizer").mkdir(parents=True)
    try:
        for name in tokenizer_files:
            if (source / name).is_file():
                shutil.copyfile(source / name, partial / "tokenizer" / name)
        final_tokenizer = out / "tokenizer" / tokenizer_model
        model = sections["model"]
        sections["model"] = {"model_family": family.name, **model, "padded_vocab_size": rows,
                             "seq_length": min(model["max_position_embeddings"], 4096)}
        sections["data"] = {"tokenizer_type": kind, "tokenizer_model": str(final_tokenizer)}
        try:  # the checks above are meant to leave nothing for these to refuse
            config = RunConfig.from_dict(sections)
        except ValueError as error:
            raise UserError(f"{where}: config.json makes a model our config refuses "
                            f"({error})") from None
        config.checkpoint.ckpt_format = "torch_dist"
        distributed.initialize(config)
        try:
            try:
                model = build_model(config, tokenizer.vocab_size, for_training=False)
            except ValueError as error:  # megatron-core's TransformerConfig checks
                raise UserError(f"{where}: config.json makes a model megatron-core does not "
                                f"build ({error})") from None
            live = unwrap(model[0]).state_dict()
            ours = family.hf.from_hf(weights, config)
            _check_shapes(ours, live, where)
            unwrap(model[0]).load_state_dict(
                {**{k: v for k, v in live.items() if k.endswith("_extra_state")},
                 **{k: v.to(live[k].dtype) for k, v in ours.items()}})
            settings = resume_settings(config, f"imported from {source.resolve()}",
                                       tokenizer.vocab_size, 1)
            save_weights(model, str(partial), settings, config, RunState().state_dict())
        finally:
            distributed.shutdown()
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    (partial / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    (partial / "model.yaml").write_text(yaml.safe_dump(sections, sort_keys=False))
    (partial / "imported_from.json").write_text(json.dumps(
        {"huggingface": str(source.resolve()),
         "architecture": (hf.get("architectures") or [hf.get("model_type")])[0]}, indent=2))
    if out.exists():
        out.rmdir()
    partial.replace(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="a Hugging Face model directory (LlamaForCausalLM, "
                        "MistralForCausalLM or MixtralForCausalLM without a sliding window, "
                        "DeepseekV3ForCausalLM: config.json, safetensors weights, tokenizer)")
    parser.add_argument("out_dir", help="the checkpoint directory to write (new)")


def next_steps(path: Path) -> list[str]:
    """The commands that fine-tune an imported model, complete as printed: it has no data of
    its own, so a run refuses its tokenizer without --data-path; the text is tokenized with
    the model's own tokenizer first (YOUR_TEXT.jsonl is the one name to replace)."""
    from shlex import quote

    tokenizer = yaml.safe_load((path / "model.yaml").read_text())["data"]
    prefix = f"{path}-data/text"
    return [f"megatron-gnmr prepare-data --input YOUR_TEXT.jsonl --output-prefix "
            f"{quote(prefix)} --tokenizer-type {tokenizer['tokenizer_type']} "
            f"--tokenizer-model {quote(tokenizer['tokenizer_model'])} --append-eod",
            f"python -m pretrain_llama --config {quote(str(path / 'model.yaml'))} "
            f"--data-path {quote(prefix + '_text_document')} --finetune "
            f"--load {quote(str(path))} --lr 1e-5 --min-lr 1e-6 --train-iters 100 "
            f"--save {quote(f'{path}-finetuned')}"]


def run(args: argparse.Namespace) -> None:
    path = import_hf(args.hf_dir, args.out_dir)
    print(f"import-hf: wrote {path}. It has no data of its own: tokenize your text with its "
          "tokenizer (YOUR_TEXT.jsonl: one {\"text\": ...} a line, or a .txt), then "
          "fine-tune on it:")
    for command in next_steps(path):
        print(f"  {command}")
