#!/usr/bin/env bash
# One prepared check of the GPU path, for a person with one GPU (under 8 minutes on an
# H100/H200): capabilities; BF16, emulated FP8, fp8-torchao (+GNMR) and te-fp8 (+GNMR) trained
# side by side for 50 steps (loss within tolerance of BF16); tokens/s and the ratio to BF16;
# recovered units bitwise equal to their BF16 layer. Prints one table (and writes it with
# --out FILE); exit 0 when every row is OK. Backends that are not installed are named.
# On an air-gapped machine: WHEELHOUSE=DIR bash scripts/gpu_check.sh (docs/guide/clusters.md, "On an
# air-gapped cluster"): setup and prepare-data then read everything from the wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/python -m megatron_gnmr.experiments.gpu_check "$@"
