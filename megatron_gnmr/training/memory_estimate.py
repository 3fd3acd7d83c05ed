"""Memory per GPU for a layout, estimated from the config before anything is built, so a
user sees before the first step (or before a launch: `megatron-gnmr estimate-memory`)
whether a layout fits.

Model state, per parameter on the busiest rank: weights (2 bytes in bf16, else 4), the
gradient buffer (4: megatron's DDP reduces in fp32 here), Adam's two moments (8) and, in
bf16, the fp32 main weights (4); the distributed optimizer divides the last two by the
data-parallel size (experts by the expert-data-parallel size). Parameters are counted on the
first and last pipeline stage (embedding / output layer) and the larger is reported.

Activations, per micro-batch and layer, counted the way Korthikanti et al. (2022, "Reducing
Activation Recomputation in Large Transformer Models") count them, for LLaMA's layer: with
T = tokens per micro-batch and B bytes per activation, the layer saves the inputs of its two
norms, of the QKV and FC1 GEMMs (4 h, replicated over TP, split by sequence parallelism), the
Q/K/V outputs (h + 2 x kv), the projection input (h), SwiGLU's two FC1 outputs (2 f), the
SiLU output and the FC2 input (2 f) (split over TP), and the softmax output (heads x s^2 per
sequence, split over TP). Selective recompute drops the softmax term; full recompute keeps only each layer's
input, plus one layer's activations while it is recomputed. MoE layers multiply the MLP
terms by top-k. The last stage adds the fp32 logits of the vocab-parallel cross-entropy. With
pipeline parallelism the first stage holds min(PP, micro-batches) micro-batches (1F1B).
It is an estimate: allocator fragmentation, communication buffers and CUDA/NCCL workspaces
(often 2-5 GiB) come on top. Host memory is `checkpoints/size.py`'s: what a torch_dist save and
load need, and the pinned part a GPU run holds from its first save to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gnmr.model_families import family_of
from megatron_gnmr.model_families.parameter_count import GIB, parameters_per_rank


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # on the busiest rank
    weights: float  # bytes
    gradients: float
    optimizer: float
    activations: float  # at the peak of a step, on the busiest stage
    activation_note: str
    recompute_peak: float  # full recompute: the one layer rebuilt at a time (in activations)
    note: str  # the layout in words

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def lines(self) -> list[str]:
        return [
            f"memory estimate per GPU (busiest rank; {self.note}):",
            f"  parameters   {self.parameters / 1e6:10.1f} M",
            f"  weights      {self.weights / GIB:10.2f} GiB",
            f"  gradients    {self.gradients / GIB:10.2f} GiB",
            f"  optimizer    {self.optimizer / GIB:10.2f} GiB",
            f"  activations  {self.activations / GIB:10.2f} GiB ({self.activation_note})",
            f"  total        {self.total / GIB:10.2f} GiB (+ buffers and workspaces)",
        ]


def estimate(config, world_size: int) -> MemoryEstimate:
    m, p, t = config.model, config.parallel, config.training
    tp, pp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.expert_model_parallel_size)
    dp = max(world_size // (tp * pp), 1)
    dense, experts = parameters_per_rank(config)
    weight_bytes = 2 if t.bf16 else 4
    optimizer_bytes = 8 + (4 if t.bf16 else 0)
    dense_share = 1 / dp if p.use_distributed_optimizer else 1
    expert_share = 1 / max(dp // ep, 1) if p.use_distributed_optimizer else 1
    microbatches = max(t.global_batch_size // (t.micro_batch_size * dp), 1)
    activations, activation_note, recompute_peak = _activations(
        config, in_flight=min(pp, microbatches))
    note = (f"TP={tp} PP={pp} DP={dp}" + (f" EP={ep}" if m.num_experts else "")
            + (", SP" if p.sequence_parallel else "")
            + (", distributed optimizer" if p.use_distributed_optimizer else "")
            + f", {t.recompute_granularity or 'no'} recompute, {'bf16' if t.bf16 else 'fp32'}")
    return MemoryEstimate(
        parameters=dense + experts,
        weights=(dense + experts) * weight_bytes,
        gradients=(dense + experts) * 4,
        optimizer=optimizer_bytes * (dense * dense_share + experts * expert_share),
        activations=activations, activation_note=activation_note,
        recompute_peak=recompute_peak, note=note)


def _activations(config, in_flight: int) -> tuple[float, str, float]:
    """Bytes at the peak of a step on the busiest stage, how they were counted, and the part
    that is one layer rebuilt by full recompute in the backward."""
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    s, b, h, f = m.seq_length, t.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    heads = m.num_attention_heads
    linears = family_of(config).attention_linears(config)
    # what the attention's GEMMs write: its input projections' outputs, the output
    # projection's input
    attention_width = sum(linear.out_features for linear in linears[:-1]) + \
        linears[-1].in_features
    tokens, size = s * b, (2 if t.bf16 else 4)
    # SwiGLU widths a token goes through: its k experts' and the shared expert's
    mlp_width = (m.moe_router_topk * (m.moe_ffn_hidden_size or f)
                 + (m.moe_shared_expert_intermediate_size or 0)) if m.num_experts else f
    split_sequence = tp if p.sequence_parallel else 1
    replicated = tokens * size * 4 * h / split_sequence
    softmax = heads * s * s * b * size / tp
    split = tokens * size * (attention_width + 4 * mlp_width) / tp
    layer = replicated + split + softmax
    layers = m.num_layers // pp
    recomputing = 0.0  # one layer's activations while full recompute rebuilds it
    if t.recompute_granularity == "full":
        stage, recomputing = layers * tokens * size * h / split_sequence, layer
    elif t.recompute_granularity == "selective":
        stage = layers * (layer - softmax)
    else:
        stage = layers * layer
    logits = tokens * config.data.vocab_size * 4 / tp
    first = in_flight * stage + recomputing + (logits if pp == 1 else 0)
    last = stage + recomputing + logits
    note = f"{b} x {s} tokens per micro-batch"
    if pp > 1:
        note += f", the first stage holds {in_flight} in flight"
    return max(first, last), note, recomputing
