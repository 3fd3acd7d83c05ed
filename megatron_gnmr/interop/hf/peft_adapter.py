"""A LoRA run's adapters as a PEFT adapter directory (`export-hf LORA_RUN OUT --adapter`), which
`peft.PeftModel.from_pretrained(LlamaForCausalLM, OUT)` applies to the exported base.

PEFT's LoRA and ours are one formula per linear, y = W x + (alpha / r) B A x, with A [r, in]
and B [out, r] stored the same way (lora_A.weight, lora_B.weight; our adapter.linear_in and
linear_out). Our fused linears are several of Hugging Face's: the fused QKV is q_proj, k_proj
and v_proj, linear_fc1 is gate_proj and up_proj. The update of one projection is its rows of
s B A, so a fused linear's adapter becomes one PEFT adapter per projection, each with the
whole A and the rows of B the weight split gives that projection (`unfused_qkv`, [gate; up]):
exact, at the cost of A stored two or three times.

The adapters are read from the LoRA checkpoint's shards (the torch format, adapters only),
one TP group's (data-parallel replicas hold the same adapters), and unsharded as
`lora/adapters.py` split them: B along its rows always; A along its rows under a
column-parallel base, along its columns under a row-parallel one. B's shard of fc1 holds the
rows of that rank's fc1 output, which megatron stacks as [gate; up] per rank (SwiGLU), so
its halves are gathered apart, as the weight's are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families import family_of, hf_mapping, row_parallel_linears
from megatron_gnmr.lora.merge import ADAPTER_IN, ADAPTER_OUT, adapted_prefixes

GATED = "mlp.linear_fc1"  # [gate; up] on every TP rank


def full_adapters(shards: list[dict], row_parallel: set[str]) -> dict[str, tuple]:
    """prefix (`decoder.layers.0.mlp.linear_fc1`) -> (A, B) whole, from one TP group's model
    states (index = TP rank)."""
    out = {}
    for prefix in adapted_prefixes(shards[0]):
        a_dim = 1 if prefix.rsplit(".", 1)[-1] in row_parallel else 0
        b = [s[prefix + ADAPTER_OUT] for s in shards]
        if prefix.endswith(GATED):
            halves = [part.chunk(2, dim=0) for part in b]
            b = [half[0] for half in halves] + [half[1] for half in halves]
        out[prefix] = (torch.cat([s[prefix + ADAPTER_IN] for s in shards], dim=a_dim),
                       torch.cat(b, dim=0))
    return out


def to_peft(adapters: dict[str, tuple], config) -> dict[str, torch.Tensor]:
    """PEFT's state dict (`base_model.model.<module>.lora_A.weight`) for whole adapters, in
    the run's family's Hugging Face projections."""
    hf = family_of(config).hf
    projections = hf.projections
    out = {}
    for prefix, (a, b) in adapters.items():
        layer, _, linear = prefix.removeprefix("decoder.layers.").partition(".")
        if linear not in projections or not layer.isdigit():
            raise UserError(f"export-hf --adapter: an adapter on {prefix} has no Hugging Face "
                            "projection")
        if len(projections[linear]) == 3:  # the fused QKV: the weight's own split
            parts = hf.unfuse_qkv(b, config)
        else:
            parts = b.chunk(len(projections[linear]), dim=0)
        for module, rows in zip(projections[linear], parts):
            name = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{name}.lora_A.weight"] = a.clone()  # one copy each: safetensors shares none
            out[f"{name}.lora_B.weight"] = rows.contiguous()
    return out


def adapter_config(config, modules: list[str], base_model: str | None) -> dict:
    """PEFT's adapter_config.json. The targets are full module paths (PEFT matches a target
    as the module's name or a suffix of it), so a glob over some layers stays exactly that."""
    lora = config.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.dim, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True}


def read_adapters(run_dir: Path, config) -> dict[str, tuple]:
    from megatron_gnmr.checkpoints import per_rank

    if not config.lora.enabled:
        raise UserError(f"export-hf {run_dir} --adapter: not a LoRA run (export it without "
                        "--adapter)")
    if config.parallel.pipeline_model_parallel_size > 1:
        raise UserError(f"export-hf {run_dir} --adapter: a pipeline-parallel LoRA run is not "
                        "exported as an adapter yet; merge it (megatron-gnmr merge-lora) and "
                        "export the merged run")
    directory = per_rank.newest_intact(str(run_dir))
    if directory is None or "lora" not in per_rank.read_meta(directory):
        raise UserError(f"export-hf {run_dir} --adapter: no complete LoRA checkpoint there")
    tp = config.parallel.tensor_model_parallel_size
    shards = [per_rank.read_shard(directory, rank)["model"][0] for rank in range(tp)]
    return full_adapters(shards, row_parallel_linears(config))


def export_adapter(run_dir: Path, out: Path, dtype: torch.dtype | None,
                   base_model: str | None) -> Path:
    """Writes OUT (new) as a PEFT adapter directory, complete or not at all; the adapters in
    `dtype` (None: the dtype the run holds them in)."""
    from safetensors.torch import save_file

    from megatron_gnmr.evaluation.loaded_run import run_config

    config = run_config(run_dir)
    hf_mapping(config, f"export-hf {run_dir} --adapter")
    if config.model.num_experts:
        raise UserError(f"export-hf {run_dir} --adapter: only dense runs' adapters are "
                        "exported (LoRA trains dense models)")
    weights = {k: v.to(dtype or v.dtype)
               for k, v in to_peft(read_adapters(run_dir, config), config).items()}
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
                      for k in weights})
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(weights, str(partial / "adapter_model.safetensors"), metadata={"format": "pt"})
    (partial / "adapter_config.json").write_text(
        json.dumps(adapter_config(config, modules, base_model), indent=2))
    if out.exists():
        out.rmdir()  # empty (checked by the caller)
    partial.replace(out)
    return out
