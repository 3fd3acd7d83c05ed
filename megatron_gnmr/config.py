"""The run's config: one typed dataclass per section, the single source of defaults.

Each component's section lives with the component (`controller/config.py`, whose risk
signals bring their knobs as settings classes of their own, `monitors/config.py`,
`precision/config.py`, `data/config.py`, `observe/config.py`, a model family's own section
such as `model_families/deepseek_mla.py`'s); this module holds the model, parallel and
training sections and composes them into `RunConfig`.
YAML files and command-line flags both map onto these dataclasses (`arguments.py`), so a
default or a range (`limits.limit`) is written exactly once. Field docstrings double as
`--help`. Each field's flag is Megatron's name for it (`--num-layers`, `--micro-batch-size`,
...); the `gnmr` section's flags carry the `--gnmr-` prefix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from megatron_gnmr.controller.config import GNMRRunConfig
from megatron_gnmr.data.config import DataConfig
from megatron_gnmr.model_families.deepseek_mla import MLAConfig
from megatron_gnmr.errors import UserError
from megatron_gnmr.limits import (MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_SEQUENCE, MAX_WIDTH,
                                  check_limits, limit)
from megatron_gnmr.lora.config import LoRAConfig
from megatron_gnmr.monitors.config import MonitorConfig
from megatron_gnmr.observe.config import LoggingConfig
from megatron_gnmr.platform.housekeeping import HousekeepingConfig
from megatron_gnmr.precision.config import PrecisionConfig


# megatron-core's OptimizerParamScheduler: its decay styles and WSD's final decay shapes.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
DEFAULT_TRAIN_ITERS = 100
# megatron-core's AttnBackend names (0.16 to 0.19; a test holds them equal)
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


@dataclass
class ModelConfig:
    model_family: str = "llama"
    """The decoder layer's attention: llama (grouped-query, fused QKV) or deepseek-mla
    (DeepSeek's multi-latent attention; its widths are the --q-lora-rank, --kv-lora-rank,
    --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim settings)."""
    num_layers: int = limit(2, ge=1, le=MAX_LAYERS)
    """Decoder layers."""
    hidden_size: int = limit(128, ge=1, le=MAX_WIDTH)
    """Model width d_model."""
    ffn_hidden_size: Optional[int] = limit(None, ge=1, le=MAX_WIDTH)
    """SwiGLU inner width (None: Megatron-LM's SwiGLU default, 8/3 x --hidden-size rounded
    down to a multiple of 64)."""
    num_attention_heads: int = limit(4, ge=1, le=MAX_HEADS)
    """Query heads."""
    num_query_groups: Optional[int] = limit(None, ge=1, le=MAX_HEADS)
    """Key/value heads for grouped-query attention (None: one per query head; llama only)."""
    seq_length: int = limit(128, ge=1, le=MAX_SEQUENCE)
    """Training sequence length in tokens."""
    kv_channels: Optional[int] = limit(None, ge=1, le=MAX_WIDTH)
    """Each attention head's width (None: --hidden-size / --num-attention-heads); llama."""
    max_position_embeddings: Optional[int] = limit(None, ge=1, le=MAX_SEQUENCE)
    """The longest sequence the model is built for (None: --seq-length); RoPE tables."""
    rotary_base: int = limit(10000, gt=0)
    """RoPE base."""
    use_rope_scaling: bool = False
    """Llama 3.1+'s RoPE frequency scaling (megatron-core's: the low frequencies slowed by
    --rope-scaling-factor, with Llama 3's fixed bands: low/high frequency factors 1 and 4 over
    an original 8,192-token context)."""
    rope_scaling_factor: float = limit(8.0, ge=1)
    """--use-rope-scaling: the factor (Llama 3.1: 8, Llama 3.2: 32)."""
    init_method_std: float = limit(0.02, gt=0)
    """Std of the normal weight initialisation."""
    norm_epsilon: float = limit(1e-5, gt=0)
    """RMSNorm epsilon."""
    apply_layernorm_1p: bool = False
    """Megatron's zero-centred gamma: each norm stores gamma - 1 (initialised to 0), so weight
    decay pulls gamma towards 1, not 0."""
    attention_dropout: float = limit(0.0, ge=0, lt=1)
    """Dropout on the attention probabilities (Megatron-LM's default 0.1; LLaMA trains with
    0)."""
    hidden_dropout: float = limit(0.0, ge=0, lt=1)
    """Dropout on the residual branches (Megatron-LM's default 0.1; LLaMA trains with 0)."""
    make_vocab_size_divisible_by: int = limit(128, ge=1)
    """Pad the embedding's vocabulary to a multiple of this x TP, as Megatron-LM pads it (the
    padded ids are never produced by the tokenizer)."""
    padded_vocab_size: Optional[int] = limit(None, ge=1)
    """The embedding's rows, when a model brings its own (`import-hf`: the Hugging Face
    model's vocab_size); default: the tokenizer's vocabulary padded as above."""
    untie_embeddings_and_output_weights: bool = True
    """A separate output layer (LLaMA's; our default). --no-untie-embeddings-and-output-weights
    ties it to the input embedding, one matrix for both (megatron-core's
    share_embeddings_and_output_weights; Megatron-LM's default, Llama 3.2 1B and 3B's
    tie_word_embeddings), at --pipeline-model-parallel-size 1."""
    num_experts: Optional[int] = limit(None, ge=2, le=MAX_EXPERTS)
    """MoE: experts per layer (megatron-core MoE layers, local experts); None: dense SwiGLU."""
    moe_router_topk: int = limit(2, ge=1)
    """MoE: experts per token."""
    moe_aux_loss_coeff: float = limit(0.0, ge=0)
    """MoE: load-balancing loss weight (0, Megatron-LM's default: no auxiliary loss)."""
    moe_ffn_hidden_size: Optional[int] = limit(None, ge=1, le=MAX_WIDTH)
    """MoE: each routed expert's inner width (None: --ffn-hidden-size). Fine-grained experts
    (DeepSeek) are narrower than a dense FFN."""
    moe_first_dense_layers: int = limit(0, ge=0)
    """MoE: the first N decoder layers keep a dense SwiGLU MLP (--ffn-hidden-size), as
    DeepSeek's first_k_dense_replace; megatron's --moe-layer-freq [0]*N+[1]*(L-N)."""
    moe_shared_expert_intermediate_size: Optional[int] = limit(None, ge=1, le=MAX_WIDTH)
    """MoE: inner width of the shared expert every token goes through (None: no shared
    expert). --gnmr: its fc1/fc2 are units too (`layers.L.mlp.shared_experts.linear_fc1`)."""
    moe_router_score_function: str = limit("softmax", choices=("softmax", "sigmoid"))
    """MoE: router scores, softmax or sigmoid (DeepSeek-V3: sigmoid, the gates normalised
    over the chosen experts)."""
    moe_router_enable_expert_bias: bool = False
    """MoE: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
    scores for the choice only, nudged after each step towards an even load."""
    moe_router_bias_update_rate: float = limit(1e-3, ge=0)
    """MoE: how far the expert bias moves per step (megatron's default)."""
    moe_router_load_balancing_type: str = limit("aux_loss",
                                                choices=("aux_loss", "seq_aux_loss", "none"))
    moe_router_num_groups: Optional[int] = limit(None, ge=1)
    """MoE: group-limited routing (DeepSeek-V3's, megatron-core's): the experts split into
    this many groups, and a token's top-k chosen only within its best --moe-router-group-topk
    groups (a group scored by the sum of its best top-k / group-topk scores)."""
    moe_router_group_topk: Optional[int] = limit(None, ge=1)
    """MoE: the groups a token may route into (with --moe-router-num-groups)."""
    moe_router_topk_scaling_factor: Optional[float] = limit(None, gt=0)
    """MoE: the chosen experts' gates scaled by this (DeepSeek-V3's routed scaling factor,
    2.5); None: not scaled."""
    moe_router_pre_softmax: bool = False
    """MoE: softmax over all experts before the top-k (megatron-core's; needed at top-1 with
    softmax scores), rather than over the chosen ones."""
    moe_router_dtype: str = limit("fp32", choices=("fp32", "fp64"))
    """MoE: the router's GEMM and scores in this precision whatever the run's (it is never a
    unit, so no recipe reaches it): fp32 always here (DeepSeek-V3 keeps its gating high), or
    fp64."""
    """MoE: aux_loss, seq_aux_loss or none (with --moe-router-enable-expert-bias: none)."""

    def __post_init__(self) -> None:
        check_limits(self, "model")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = swiglu_ffn_hidden_size(self.hidden_size)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = limit(1, ge=1)
    """TP degree: splits heads and FFN columns across ranks."""
    pipeline_model_parallel_size: int = limit(1, ge=1)
    """PP degree: splits layers into stages (megatron's 1F1B schedule)."""
    expert_model_parallel_size: int = limit(1, ge=1)
    """EP degree for MoE: experts split across data-parallel ranks."""
    sequence_parallel: bool = False
    """Split the sequence of the norm and residual regions across the TP ranks (activation
    memory / TP; off at TP = 1, as Megatron-LM turns it off; megatron requires it for MoE with
    TP). --gnmr: unchanged (norm gradients are TP-reduced before the controller reads
    them)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state and main weights over data-parallel ranks (ZeRO-1).
    --gnmr: each rank holds a shard of every gradient, so the per-unit norms sum shards over
    DP too, still in one all-reduce."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during the backward pass. --gnmr: unchanged (the controller
    reads the gradients after the reduction has finished)."""
    overlap_param_gather: bool = False
    """Gather updated parameter shards during the next forward (needs
    --use-distributed-optimizer and --overlap-grad-reduce). --gnmr: unchanged."""
    distributed_backend: str = limit("nccl", choices=("nccl", "gloo"))
    """Megatron-LM's collectives backend: nccl runs NCCL on GPUs and gloo where there is none
    (a CPU run; said once at its start); gloo on a GPU machine is refused (megatron-gnmr's GPU
    collectives are NCCL's)."""

    def __post_init__(self) -> None:
        check_limits(self, "parallel")
        if self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # Megatron-LM's rule: nothing to split over


@dataclass
class TrainingConfig:
    micro_batch_size: int = limit(4, ge=1)
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: Optional[int] = limit(None, ge=1)
    """Sequences per optimizer step over all data-parallel ranks (gradient accumulation;
    None: --micro-batch-size x the data-parallel size, Megatron-LM's default)."""
    train_iters: Optional[int] = limit(None, ge=1)
    """Optimizer steps (default 100 unless --train-samples gives them)."""
    train_samples: Optional[int] = limit(None, ge=1)
    """Megatron's sample-based length: train on this many samples (train_iters = samples //
    global batch), the LR schedule then counted in samples (--lr-*-samples)."""
    lr: float = limit(3e-3, ge=0)
    """Peak learning rate (Megatron-LM has no default: give it)."""
    min_lr: float = limit(0.0, ge=0)
    """Learning rate at the end of the decay (Megatron-LM's default 0)."""
    lr_decay_style: str = limit("linear", choices=LR_DECAY_STYLES)
    """Megatron's LR decay after warm-up: constant, linear (Megatron-LM's default), cosine,
    inverse-square-root or WSD (warm-up, stable, then decay over --lr-wsd-decay-iters)."""
    lr_decay_iters: Optional[int] = limit(None, ge=1)
    """Iterations to decay over (default: --train-iters)."""
    lr_decay_samples: Optional[int] = limit(None, ge=1)
    """Samples to decay over, with --train-samples (default: --train-samples)."""
    lr_warmup_iters: int = limit(0, ge=0)
    """Linear warm-up iterations."""
    lr_warmup_samples: int = limit(0, ge=0)
    """Linear warm-up samples, with --train-samples."""
    lr_warmup_fraction: Optional[float] = limit(None, ge=0, le=1)
    """Warm-up as a fraction of the decay length (instead of --lr-warmup-iters/-samples)."""
    lr_warmup_init: float = limit(0.0, ge=0)
    """The learning rate the warm-up starts from."""
    lr_wsd_decay_style: str = limit("exponential", choices=WSD_DECAY_STYLES)
    """WSD: the shape of its final decay (exponential, linear, cosine, minus_sqrt)."""
    lr_wsd_decay_iters: Optional[int] = limit(None, ge=1)
    """WSD: iterations of its final decay."""
    lr_wsd_decay_samples: Optional[int] = limit(None, ge=1)
    """WSD: samples of its final decay, with --train-samples."""
    weight_decay: float = limit(0.01, ge=0)
    """AdamW decoupled weight decay (Megatron-LM's default 0.01; LLaMA trains with 0.1)."""
    start_weight_decay: Optional[float] = limit(None, ge=0)
    """Weight decay at the start (default --weight-decay), with --weight-decay-incr-style."""
    end_weight_decay: Optional[float] = limit(None, ge=0)
    """Weight decay at the end (default --weight-decay)."""
    weight_decay_incr_style: str = limit("constant", choices=("constant", "linear", "cosine"))
    """How weight decay goes from --start-weight-decay to --end-weight-decay."""
    adam_beta1: float = limit(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = limit(0.999, ge=0, lt=1)
    """AdamW beta2 (Megatron-LM's default 0.999; LLaMA trains with 0.95)."""
    adam_eps: float = limit(1e-8, gt=0)
    """AdamW epsilon."""
    decoupled_lr: Optional[float] = limit(None, ge=0)
    """The input and output embeddings' own peak learning rate (megatron-core's optimizer)."""
    decoupled_min_lr: Optional[float] = limit(None, ge=0)
    """... and their own final learning rate."""
    grad_reduce_in_bf16: bool = False
    """Reduce gradients over data-parallel ranks in bf16 (default: fp32)."""
    cross_entropy_loss_fusion: bool = False
    """megatron-core's fused cross entropy (its `native` implementation)."""
    calculate_per_token_loss: bool = False
    """Average the loss over every token of the step (megatron-core scales the gradients by
    the step's token count) rather than per micro-batch."""
    clip_grad: float = limit(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables)."""
    bf16: bool = False
    """Train in bf16 (fp32 master weights). Off on CPU by default: bf16 matmuls are slower."""
    seed: int = limit(1234, ge=0, lt=2**32)
    """Seed for weights, data order and dropout."""
    use_cpu_initialization: bool = False
    """GPU: draw the full weights on the CPU and split them (every TP layout then starts from
    the same model; slow for large models). Always on when there is no GPU."""
    log_interval: int = limit(100, ge=1)
    """Print and log metrics every N steps (Megatron-LM's default 100)."""
    eval_interval: int = limit(50, ge=1)
    """Validation every N steps (and at the end; Megatron-LM has no default: give it)."""
    eval_iters: int = limit(100, ge=1)
    """Validation batches per evaluation (Megatron-LM's default 100)."""
    distributed_timeout_minutes: int = limit(10, ge=1)
    """A collective that waits longer than this (a rank died or hangs) fails the run."""
    stop_on_divergence: bool = False
    """Stop (after checkpointing) once the run has diverged: the 20-step mean training loss
    20% above its running minimum, after step 100 (training/divergence.py); for sweeps."""
    inject_nonfinite: Optional[str] = None
    """Test only: STEP:UNIT[,...] puts a NaN into that unit's gradient at that step."""
    recompute_granularity: Optional[str] = limit(None, choices=("full", "selective"))
    """Activation recompute: `selective` (core attention is recomputed in the backward, so
    its heads x seq^2 scores are never stored; cheap) or `full` (whole layers, with
    --recompute-method); None: off. --gnmr: unchanged (a recomputed forward runs the same
    precision path, so the backward still sees its forward's precision)."""
    recompute_method: Optional[str] = limit(None, choices=("uniform", "block"))
    """Full recompute: `uniform` (chunks of --recompute-num-layers layers) or `block` (the
    first --recompute-num-layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = limit(None, ge=1)
    """Full recompute: layers per chunk (uniform) or recomputed layers per stage (block)."""
    gradient_accumulation_fusion: bool = False
    """Accumulate weight gradients into main_grad inside the GEMM (GPU with apex/TE only;
    not with emulated or switchable precision, whose weight gradient is its own GEMM)."""
    attention_backend: str = limit("auto", choices=ATTENTION_BACKENDS)
    """Core attention: auto, flash, fused, unfused (Transformer Engine's kernels, in the TE
    layers of --precision-recipe te-fp8) or local (megatron's own). In the local layers: torch's
    scaled_dot_product_attention, except local and unfused (megatron's unfused attention)."""
    use_flash_attn: bool = False
    """Megatron's older spelling of --attention-backend flash."""
    compile: bool = False
    """torch.compile each transformer layer (training/layer_compile.py); a unit's switch
    between its paths is a guarded choice of two compiled variants. Local layers only."""
    quantizer_compile: str = limit("auto", choices=("auto", "on", "off"))
    """The emulated quantizers through torch.compile, bit for bit the eager ones: auto (GPU
    tensors of 2^16 elements or more; on the CPU compiling measured no faster), on (all), off
    (eager). Eager, said once, where torch.compile cannot run."""
    emulated_attention: bool = False
    """Core attention through an explicit flash-attention-style backward (fault studies)."""
    attention_fault_bits: int = limit(0, ge=0, le=10)
    """Fault study: round O to N mantissa bits in delta = rowsum(dO * O) (0: off; the rung's
    other knobs: precision/attention_fault.py)."""
    attention_fault_rounding: str = limit("down", choices=("down", "nearest"))
    """Fault study: the rounding's direction: down (toward -inf, a bias) or nearest (ties to
    even: the same grid without a bias)."""
    attention_fault_share: float = limit(1.0, gt=0, le=1)
    """Fault study: the share of O's elements the rounding takes (drawn per layer and step);
    the others are held as the healthy low path holds them."""
    attention_fault_peak: float = limit(0.0, ge=0, lt=1)
    """Fault study: only rows whose largest attention probability reaches this (0: every row);
    the others are held as the healthy low path holds them."""
    attention_fault_start: int = limit(1, ge=1)
    """Fault study: the step the attention fault switches on."""
    attention_fault_layers: str = "all"
    """Fault study: the layers whose core attention has the fault: all, a comma list of layer
    numbers (0-based), or drawn:K (K layers drawn from --seed, so each seed fails elsewhere)."""

    def __post_init__(self) -> None:
        check_limits(self, "training")
        if self.global_batch_size is not None:
            self.settle_length()

    def settle_length(self) -> None:
        """train_iters from --train-samples (or the default), once the global batch is known."""
        if self.train_samples is not None:
            iters = self.train_samples // self.global_batch_size
            if self.train_iters not in (None, iters):
                raise ValueError("training.train_samples and train_iters are exclusive: give "
                                 "one (Megatron-LM's rule)")
            if iters < 1:
                raise ValueError(f"training.train_samples {self.train_samples} is less than one "
                                 f"global batch ({self.global_batch_size})")
            self.train_iters = iters
        elif self.train_iters is None:
            self.train_iters = DEFAULT_TRAIN_ITERS


@dataclass
class CheckpointConfig:
    """Where a run's checkpoints go and come from, in which form, and when a run stops to
    save (Megatron-LM's flags). YAML: the `checkpoint:` section (these keys under
    `training:` are still read, with a notice)."""

    save: Optional[str] = None
    """Run directory: checkpoints, metrics.jsonl and traces go here."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (its `latest`); with --finetune, the base run."""
    finetune: bool = False
    """Megatron's --finetune: read only the model weights of --load (no optimizer, scheduler,
    RNG or step) and start at step 0. With --lora, the fine-tune's checkpoints hold the
    adapters and a pointer to the base (its path and hash), which a resume reloads."""
    resume: Optional[str] = limit(None, choices=("auto",))
    """`auto`: resume from the newest complete checkpoint in --save if there is one."""
    overwrite: bool = False
    """Start a new run in a --save directory that holds another run's checkpoints, deleting
    them (without it, such a launch is refused)."""
    save_interval: int = limit(0, ge=0)
    """Checkpoint every N steps (0: only at the end, if --save is set)."""
    keep_last: int = limit(2, ge=1)
    """Checkpoints kept in --save (older ones are deleted after a new one is complete)."""
    ckpt_format: Optional[str] = limit(None, choices=("torch_dist", "torch"))
    """torch_dist (megatron-core's dist_checkpointing in Megatron-LM's layout: one copy of
    each tensor, resharded on load, so a resume may change TP/PP/DP/EP; the default) or torch
    (per-rank files, the same layout only; the default of LoRA runs, whose fine-tunes'
    checkpoints hold the adapters alone and which merge-lora reads). A resume reads either."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """torch_dist with --use-distributed-optimizer: save the optimizer in its fully
    reshardable form, so a resume may change TP, PP or EP (each rank gathers its TP/PP shard's
    whole state: 12 bytes per parameter of the shard in host memory, at every save and load;
    `estimate-memory` gives the bytes). Without it, Megatron-LM's default: the DP-reshardable
    form (each rank writes its own part, no gather; a resume may change DP only)."""
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """With --dist-ckpt-optim-fully-reshardable: gather to data-parallel rank 0 alone (over
    gloo), which writes the optimizer; the other ranks hold nothing extra at a save."""
    async_save: bool = False
    """torch_dist: write checkpoints while training goes on (megatron-core's async save: the
    loop waits for the copy to host only); a checkpoint is published, hashed and complete,
    once every rank has written it. The last save of a run (its end, a stop) is synchronous."""
    ckpt_fully_parallel_load: bool = False
    """torch_dist: each data-parallel replica reads a share of the checkpoint and they
    exchange the rest (Megatron-LM's flag), instead of every rank reading all it needs."""
    no_load_optim: bool = False
    """Resume without the optimizer's and the LR scheduler's state (Megatron-LM's meaning)."""
    no_load_rng: bool = False
    """Resume without the RNG state (re-derived from the seed and the step, as a run's start
    seeds them)."""
    use_checkpoint_args: bool = False
    """Read the model's settings (every --model and family flag) from --load's checkpoint, as
    Megatron-LM does to fine-tune a converted checkpoint without restating its shape; a flag
    given that disagrees with the checkpoint is refused, naming both."""
    ckpt_step: Optional[int] = limit(None, ge=0)
    """Load the checkpoint of this step from --load (Megatron-LM's meaning), and no other: a
    missing or corrupt one is an error, not a fallback."""
    override_opt_param_scheduler: bool = False
    """On resume, this run's LR schedule flags win over the checkpoint's (Megatron-LM's)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, the checkpoint's LR schedule wins over this run's flags (Megatron-LM's)."""
    exit_signal_handler: bool = False
    """Also save and exit 0 on --exit-signal (SIGTERM always does)."""
    exit_signal: str = limit("SIGTERM", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"))
    """--exit-signal-handler: the signal (SLURM sends SIGUSR1 ahead of a time limit with
    `--signal=USR1@120`)."""
    exit_interval: int = limit(0, ge=0)
    """Stop (after checkpointing) once the step count is a multiple of N (0: never)."""
    exit_duration_in_mins: Optional[float] = limit(None, gt=0)
    """Checkpoint and exit (status 0) at the end of the first step after the run has lasted
    this many minutes (a scheduler's time limit)."""

    def __post_init__(self) -> None:
        check_limits(self, "checkpoint")
        if self.distrib_optim_fully_reshardable_mem_efficient and \
                not self.dist_ckpt_optim_fully_reshardable:
            raise UserError("--distrib-optim-fully-reshardable-mem-efficient is a way of "
                            "writing the fully reshardable form: add "
                            "--dist-ckpt-optim-fully-reshardable")
        if self.load is not None and self.save is not None and not self.finetune and \
                os.path.realpath(self.load) == os.path.realpath(self.save):
            # Megatron-LM's --save X --load X: resume from X when it holds a checkpoint
            self.load, self.resume = None, "auto"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)  # the deepseek-mla family's settings
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    gnmr: GNMRRunConfig = field(default_factory=GNMRRunConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    housekeeping: HousekeepingConfig = field(default_factory=HousekeepingConfig)

    def __post_init__(self) -> None:
        t, p = self.training, self.parallel
        if t.global_batch_size is None:  # Megatron-LM's: one micro-batch per data-parallel rank
            model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
            t.global_batch_size = t.micro_batch_size * max(1, launch_world_size() //
                                                           model_parallel)
            t.settle_length()
        c = self.checkpoint
        if c.ckpt_format is None:  # LoRA's checkpoints (adapters, merge-lora) are per-rank
            c.ckpt_format = "torch" if self.lora.enabled else "torch_dist"
        self._refuse_what_moe_cannot_do()

    def _refuse_what_moe_cannot_do(self) -> None:
        """MoE's combinations that cannot run, refused while the flags are parsed (before
        megatron-core is imported, let alone a model built)."""
        if not self.model.num_experts:
            return
        if self.lora.enabled:
            raise UserError("--lora with --num-experts is not supported yet (LoRA adapts dense "
                            "models only): drop --lora, or fine-tune the MoE model in full")
        if self.parallel.tensor_model_parallel_size > 1 and not self.parallel.sequence_parallel:
            raise UserError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                            "(megatron-core requires it): add --sequence-parallel")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """A run's config.json back (sections it lacks keep their defaults; fields of a
        config.json written before they moved to a section of their own, read there)."""
        hints = typing.get_type_hints(cls)
        sections: dict[str, dict] = {}
        for section, fields in values.items():
            for name, value in (fields or {}).items() if isinstance(fields, dict) else ():
                sections.setdefault(moved_section(section, name), {})[name] = value
        return cls(**{name: hints[name](**sections[name]) for name in hints if name in sections})


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's --ffn-hidden-size when absent with --swiglu (both our families): 4 x
    hidden x 2/3, rounded down to a multiple of 64 (`validate_args`, core_v0.16.1)."""
    width = int((4 * hidden_size * 2 / 3) / 64) * 64
    if width < 1:
        raise UserError(f"--ffn-hidden-size: Megatron-LM's default for --hidden-size "
                        f"{hidden_size} (8/3 x hidden rounded down to a multiple of 64) is 0; "
                        "give --ffn-hidden-size")
    return width


def launch_world_size() -> int:
    """Processes in this launch (torchrun sets WORLD_SIZE; a plain `python` run is 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


SECTIONS = {name: kind for name, kind in typing.get_type_hints(RunConfig).items()}
# Fields that moved to a section of their own: (old section, field) -> new section. A YAML
# file or a run's config.json written before the move still reads.
MOVED = {("training", f.name): "checkpoint" for f in dataclasses.fields(CheckpointConfig)}


def moved_section(section: str, name: str) -> str:
    """The section a field of `section` lives in now."""
    return MOVED.get((section, name), section)


def flag_name(section: str, name: str) -> str:
    """The command-line flag of a config field (Megatron's name; `--gnmr-*` and `--lora-*`
    for the controller's and LoRA's sections)."""
    if section in ("gnmr", "lora"):
        return f"--{section}" if name == "enabled" else f"--{section}-{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')}"
