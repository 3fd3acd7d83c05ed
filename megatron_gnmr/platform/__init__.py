"""Platform layer: what the machine can do, and the patches megatron-core needs on CPU."""

from megatron_gnmr.platform.capabilities import Capability, cuda, transformer_engine
from megatron_gnmr.platform.cpu_patches import apply_cpu_patches

__all__ = ["Capability", "apply_cpu_patches", "cuda", "transformer_engine"]


def quiet_known_warnings() -> None:
    """Silence megatron-core's import-time notices that say nothing actionable here
    (missing apex/TE fallbacks are expected on CPU; TE's absence is reported by
    `capabilities.transformer_engine()` when a flag needs it)."""
    import warnings

    for pattern in (r".*(Apex|Transformer Engine and Apex) (is|are) not installed",
                    r"full scope is deprecated",
                    r"When using async grad allreduce it is recommended",  # CUDA-only advice
                    r"When using sequence parallelism it is recommended",  # CUDA-only advice
                    # selective recompute: advice for TE's fused attention, said every build
                    r"If you are using transformer_engine as the transformer implementation",
                    # torch 2.13 renames collectives that megatron-core still calls
                    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                    r"is deprecated"):
        warnings.filterwarnings("ignore", message=pattern)
