"""Platform layer: what the machine can do, and the patches megatron-core needs on CPU."""

from megatron_gnmr.platform.capabilities import Capability, cuda, transformer_engine
from megatron_gnmr.platform.cpu_patches import apply_cpu_patches

__all__ = ["Capability", "apply_cpu_patches", "cuda", "transformer_engine"]
