#!/usr/bin/env bash
# Issue 56 item 5, the learning-rate edge: BF16 and the default FP8 recipe (attention included)
# at seven peak LRs, 3 seeds, 2,000 steps; nothing injected. Then compare-lr-edge: final loss
# against LR per arm, each arm's edge, and the curves (docs/runs/lr_edge/). About 4 minutes of
# one core per run; two at a time; an interrupted sweep resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
.venv/bin/megatron-gnmr reproduce lr_edge "$@"
if [ "${1:-}" != "--smoke" ]; then
  .venv/bin/megatron-gnmr compare-lr-edge lr_edge
fi
