#!/usr/bin/env bash
# Issue 20, step one: NVFP4's damage on a 4 x 256 model against the seed-to-seed noise of the
# paired measure (8 runs, 400 steps; ~25 min on 2 cores; add --smoke for a one-minute check).
# Results in results/frontier_nvfp4_noise/ (results.md, results.json, report.png, run dirs).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/megatron-gnmr reproduce frontier_nvfp4_noise "$@"
