"""Precision: number formats, scaling, paths and recipes, and the per-step plan."""

from megatron_gnmr.precision.plan import PrecisionPlan, PrecisionRuntime

__all__ = ["PrecisionPlan", "PrecisionRuntime"]
