"""The LLaMA architecture as a megatron-core GPTModel: RMSNorm, SwiGLU, RoPE, no bias,
grouped-query attention, untied embeddings (tied with --no-untie-embeddings-and-output-weights).

`build_model` returns this pipeline stage's model chunk wrapped the way megatron's own
training does it (Float16Module for bf16, then megatron's DDP), so gradients land in
`param.main_grad` and are data-parallel reduced by `finalize_model_grads`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig  # (or the family's subclass)
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from megatron_gnmr.config import RunConfig
from megatron_gnmr.model_families import family_of
from megatron_gnmr.platform import megatron_compat
from megatron_gnmr.platform.device import has_accelerator, run_device
from megatron_gnmr.precision.linear import emulated_layer_spec
from megatron_gnmr.precision.backends import backend as precision_backend
from megatron_gnmr.precision.backends import build_recipe


def transformer_config(config: RunConfig) -> TransformerConfig:
    """megatron's config of the model: the family's config class and attention fields."""
    m, p, t = config.model, config.parallel, config.training
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    config_class, family_fields = family_of(config).transformer_config(config)
    return config_class(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        **family_fields,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=t.bf16,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        gated_linear_unit=True,  # SwiGLU = SiLU-gated linear unit
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        # On the CPU, full weights are drawn and then split, so every TP layout starts
        # identical; on a GPU each rank draws its shard on the device (megatron's default,
        # fast for large models), unless --use-cpu-initialization asks for the former.
        use_cpu_initialization=t.use_cpu_initialization or not has_accelerator(),
        perform_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=t.gradient_accumulation_fusion,
        persist_layer_norm=False,
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        attention_backend=attention_backend(t),
        cross_entropy_loss_fusion=t.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl="native",
        calculate_per_token_loss=t.calculate_per_token_loss,
        **_moe_fields(config),
        **precision_backend(config.precision).megatron_fields(config.precision),
    )


def attention_backend(training) -> AttnBackend:
    """megatron's attention backend (--use-flash-attn is its older spelling of flash)."""
    return AttnBackend.flash if training.use_flash_attn else AttnBackend[training.attention_backend]


def attention_backend_note(config: RunConfig) -> str | None:
    """A Transformer Engine kernel named for megatron-core's local layers: what runs instead
    (said at start, not refused): torch's SDPA for flash and fused, megatron's own unfused
    attention for unfused (as --attention-backend local)."""
    t = config.training
    chosen = "flash" if t.use_flash_attn else t.attention_backend
    if chosen not in ("flash", "fused", "unfused") or \
            precision_backend(config.precision).transformer_engine_layers:
        return None
    instead = "megatron-core's own unfused attention runs (as with --attention-backend local)" \
        if chosen == "unfused" else ("torch's scaled_dot_product_attention runs (torch picks "
                                     "its flash, memory-efficient or cuDNN kernel)")
    return (f"--attention-backend {chosen} names a Transformer Engine kernel; these layers are "
            f"megatron-core's local ones: {instead}, unless the core attention is an emulated "
            "unit")


def _moe_fields(config: RunConfig) -> dict:
    m = config.model
    if not m.num_experts:
        return {}
    return {
        "num_moe_experts": m.num_experts,
        "moe_layer_freq": [0] * m.moe_first_dense_layers + [1] * (m.num_layers
                                                                 - m.moe_first_dense_layers),
        "moe_router_topk": m.moe_router_topk,
        "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": m.moe_router_load_balancing_type,
        "moe_router_score_function": m.moe_router_score_function,
        "moe_router_enable_expert_bias": m.moe_router_enable_expert_bias,
        "moe_router_bias_update_rate": m.moe_router_bias_update_rate,
        "moe_router_num_groups": m.moe_router_num_groups,
        "moe_router_group_topk": m.moe_router_group_topk,
        "moe_router_topk_scaling_factor": m.moe_router_topk_scaling_factor,
        "moe_router_pre_softmax": m.moe_router_pre_softmax,
        "moe_router_dtype": m.moe_router_dtype,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "expert_model_parallel_size": config.parallel.expert_model_parallel_size,
    }


def layer_specs(config: RunConfig) -> list:
    """One layer spec per decoder layer: dense for the first --moe-first-dense-layers of an
    MoE model, MoE for the rest."""
    m = config.model
    if not m.num_experts:
        return [layer_spec(config)] * m.num_layers
    dense, moe = layer_spec(config, moe=False), layer_spec(config)
    return [dense if layer < m.moe_first_dense_layers else moe for layer in range(m.num_layers)]


def layer_spec(config: RunConfig, moe: bool = True):
    """The spec of one decoder layer: an MoE layer if the model has experts and `moe`."""
    num_experts = config.model.num_experts if moe else None
    backend = precision_backend(config.precision)
    family = family_of(config)
    if backend.layer_spec is not None:
        return backend.layer_spec(family, config, num_experts)
    spec = family.local_layer_spec(config, num_experts)
    core_attention = local_core_attention(config, family)
    if core_attention is not None:
        spec = copy.deepcopy(spec)
        megatron_compat.attention_submodules(spec).core_attention = core_attention
    if backend.recipe is not None:
        spec = emulated_layer_spec(spec, family)
    return spec


def local_core_attention(config: RunConfig, family) -> type | None:
    """The core attention of a local layer: the emulated flash attention where it is a unit
    with a low-precision path (or asked for, or the family's own attention needs it), else
    torch's SDPA, unless --attention-backend local (or unfused) asks for megatron's own
    unfused attention (None: the spec's)."""
    from megatron_gnmr.precision.attention_unit import switchable_attention

    emulated = config.training.emulated_attention or switchable_attention(config)
    if not emulated and not megatron_unfused_attention(config.training):
        from megatron_gnmr.precision.sdpa_attention import SdpaAttention

        return SdpaAttention
    if emulated or getattr(family, "needs_emulated_core_attention", False):
        from megatron_gnmr.precision.attention_unit import EmulatedFlashAttention

        return EmulatedFlashAttention
    return None


def megatron_unfused_attention(training) -> bool:
    """--attention-backend local (megatron's own) or unfused: the scores materialized."""
    return not training.use_flash_attn and training.attention_backend in ("local", "unfused")


def build_gpt_model(config: RunConfig, tconfig: TransformerConfig, vocab_size: int) -> GPTModel:
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=megatron_compat.decoder_block_spec(layer_specs(config), tconfig),
        vocab_size=vocab_size,
        max_sequence_length=config.model.max_position_embeddings or config.model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not config.model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=config.model.rotary_base,
        rope_scaling=config.model.use_rope_scaling,
        rope_scaling_factor=config.model.rope_scaling_factor,
    )
    if config.precision.moe_dispatch_quant:
        from megatron_gnmr.precision.dispatch import install_dispatch_quantization

        install_dispatch_quantization([model])
    return model


def padded_vocab_size(vocab_size: int, config: RunConfig) -> int:
    """The embedding's rows for a tokenizer of `vocab_size` ids, padded as Megatron-LM pads
    them: to a multiple of --make-vocab-size-divisible-by x TP."""
    if config.model.padded_vocab_size is not None:
        return config.model.padded_vocab_size
    multiple = config.model.make_vocab_size_divisible_by * \
        config.parallel.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def build_model(config: RunConfig, vocab_size: int,
                for_training: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks (one: no virtual pipeline), ready for megatron's schedules.
    `vocab_size`: the tokenizer's (padded here). `for_training` False (the tools: evaluate,
    export, import, merge): no gradients and no DDP wrapper, whose float32 gradient buffer
    alone is twice a bf16 model's weights (the tools must fit where the model fits)."""
    tconfig = transformer_config(config)
    model: torch.nn.Module = build_gpt_model(config, tconfig,
                                             padded_vocab_size(vocab_size, config))
    if config.lora.enabled:  # before DDP: its buffers hold the trainable parameters only
        add_lora(model, config, tconfig)
    # On the run's device before megatron's wrappers (as megatron's own `get_model` does):
    # DDP's gradient buffers and the optimizer take the parameters where they are.
    model.to(run_device())
    if tconfig.bf16:
        model = Float16Module(tconfig, model)
    if not for_training:
        model.requires_grad_(False)
        return [model]
    p = config.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not config.training.grad_reduce_in_bf16,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(tconfig, ddp_config, model)
    return [model]


def add_lora(model: GPTModel, config: RunConfig, tconfig: TransformerConfig) -> None:
    """Adapters on the targeted unit linears of this stage; everything else frozen."""
    from megatron_gnmr.controller.units import UnitShape, local_unit_modules
    from megatron_gnmr.lora.adapters import attach_adapters, freeze_base, lora_targets

    attach_adapters(local_unit_modules([model], UnitShape.of(config)), config.lora,
                    lora_targets(config), tconfig)
    freeze_base(model)


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def count_parameters(model_chunks: list[torch.nn.Module]) -> int:
    """Parameters on this rank (a TP/PP shard)."""
    return sum(p.numel() for chunk in model_chunks for p in chunk.parameters())


def bind_precision(unit_modules: dict[str, torch.nn.Module], config: RunConfig, plan,
                   probes=None) -> None:
    """Tell every unit linear its name and the runtime that picks its path per step (and
    measures its low path, with `probes`)."""
    from megatron_gnmr.precision.plan import PrecisionRuntime

    backend = precision_backend(config.precision)
    if backend.recipe is None and backend.layer_spec is None:
        return  # megatron's own linears: nothing switches
    runtime = PrecisionRuntime(build_recipe(config.precision), plan,
                               probes if probes is not None and probes.watches("linear")
                               else None,
                               config.precision.precision_recovery_gemms.split(","))
    for name, module in unit_modules.items():
        module.unit_name = name
        module.precision_runtime = runtime
