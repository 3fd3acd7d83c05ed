#!/usr/bin/env bash
# Issues 30 and 45: the closed loop on the attention fault (FP8 attention with a biased backward),
# 8 seeds x 7 variants, runs stopped once diverged (about 3 CPU hours on 2 cores; add --smoke
# for the one-minute size). Results in results/attention_closed_loop/; the per-run summaries
# and the table in docs/runs/attention_closed_loop/ (what the repository keeps).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
.venv/bin/megatron-gnmr reproduce attention_closed_loop "$@"
if [ "${1:-}" != "--smoke" ]; then
  .venv/bin/megatron-gnmr compare-closed-loop attention_closed_loop \
    --earlier docs/runs/attention_closed_loop_issue30
fi
