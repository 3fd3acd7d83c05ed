#!/usr/bin/env bash
# One prepared check of the GPU path, for a person with one GPU (meant to take under 8
# minutes on an H100/H200; not yet timed on one): prints one table. (a) te-fp8 units forced
# onto the recovery path at step k and back at k+1: forward, dgrad, wgrad bitwise `te` BF16's,
# and the FP8 output at k+1 a fresh FP8 forward's; (b) tokens/s of te-fp8 against `te` BF16
# and of fp8-torchao against BF16, both compiled alike, at 2 layers / hidden 4096 / FFN 14336 /
# sequence 4096; (c) the controller's cost (its step against the step without it, its own
# per-step work under CUDA-synchronised timers); (d) torchao's recovered units bitwise BF16,
# backward included; each FP8 arm's loss; a save -> resume on the device. A row that cannot
# run (no Transformer Engine, no torchao) fails with the reason. Exit 0 when every row passed.
# On an air-gapped machine: WHEELHOUSE=DIR bash scripts/gpu_check.sh (docs/guide/clusters.md, "On an
# air-gapped cluster"): setup and prepare-data then read everything from the wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/python -m megatron_gnmr.gpu_check.check "$@"
