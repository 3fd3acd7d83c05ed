#!/usr/bin/env bash
# Issue 24: why did emulated E4M3 train worse than FP6? 59 training runs of the
# risk_signals_deepseek model (2 x 128, 400 steps), two at a time: ~45 minutes on 2 cores
# (add --smoke for a one-seed, 20-step check). A finished run is kept, so a cut run resumes.
# Results in results/e4m3_question/ (results.md, results.json, one run directory per run).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/python -m megatron_gnmr.experiments.e4m3_question "$@"
