#!/usr/bin/env bash
# Issue 56 item 5, the LR edge's controlled round (configs/scenarios/lr_edge_arms.yaml, written
# by experiments/lr_edge_arms.py before any of its runs): at 0.024 and 0.048, where FP8 fails
# and BF16 lives, BF16, FP8, every core attention exact and the fault ladder's arms, 3 seeds,
# 2,000 steps. Then compare-lr-edge with the goal declared in results.md section 14: which
# arm holds within 0.1 of BF16 up to one LR step below BF16's divergence edge, at what share
# of the GEMM FLOPs (docs/runs/lr_edge_arms/). Two runs at a time; an interrupted round
# resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
.venv/bin/megatron-gnmr reproduce lr_edge_arms --jobs 2 "$@"
if [ "${1:-}" != "--smoke" ]; then
  .venv/bin/megatron-gnmr compare-lr-edge lr_edge_arms --traced-arm fp8 \
    --sweep docs/runs/lr_edge/lr_edge.json
fi
