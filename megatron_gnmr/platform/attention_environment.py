"""megatron-core's record of a model's attention backend, kept in the environment.

When megatron-core (0.16 to 0.19) builds a language model it writes NVTE_FLASH_ATTN,
NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN for the model's attention backend (Transformer Engine
reads them to pick its kernel), and asserts that a value already there agrees. So a value
left in the environment, by the user's shell or by an earlier model in the same process,
decides whether a build fails, and its children inherit it: a launch checks the environment
before anything is built, and a process that builds several models (tests, benchmarks)
forgets the record between them, as separate launches would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")

# What LanguageModule._set_attention_backend writes for each backend, in VARIABLES' order
# (the same in megatron-core 0.16.1 and 0.19.2; NVTE_FLASH_ATTN_V* is written only for a
# flash_attention_version, which this project never sets).
WRITTEN = {"local": (0, 0, 0), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
           "auto": (1, 1, 1)}


def disagreements(backend: str,
                  environ: Mapping[str, str] = os.environ) -> dict[str, tuple[str, str]]:
    """The variables set in `environ` to a value megatron-core would refuse for `backend`:
    name -> (the value found, the value it would write)."""
    return {name: (environ[name], str(value)) for name, value in zip(VARIABLES, WRITTEN[backend])
            if environ.get(name) not in (None, str(value))}


def forget() -> None:
    """Drop the record, so the next model built in this process decides its own backend."""
    for name in VARIABLES:
        os.environ.pop(name, None)
