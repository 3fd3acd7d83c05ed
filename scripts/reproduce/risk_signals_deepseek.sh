#!/usr/bin/env bash
# Reproduce the risk_signals_deepseek scenario on a fresh machine (add --smoke for the few-minute size);
# results in results/risk_signals_deepseek/ (results.md, results.json, report.png, one run dir per seed).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/megatron-gnmr reproduce risk_signals_deepseek "$@"
