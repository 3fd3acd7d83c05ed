"""Precision paths: the per-step plan of which units run the recovery path."""

from megatron_gnmr.precision.plan import PrecisionPlan

__all__ = ["PrecisionPlan"]
