"""The GNMR controller: a pure decision policy, and the distributed code around it."""

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import Decision, GNMRPolicy

__all__ = ["Decision", "GNMRConfig", "GNMRPolicy"]
