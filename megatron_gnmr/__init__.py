"""megatron-gnmr: low-precision LLaMA pretraining on megatron-core with the GNMR controller."""

__version__ = "0.1.0"
