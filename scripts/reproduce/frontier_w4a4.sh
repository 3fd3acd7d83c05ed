#!/usr/bin/env bash
# Issue 31: the gate of the W4A4 forward-quantizing stress (docs/results.md section 12): all-low
# against all-high, 4 seeds (about 25 minutes on 2 cores). It failed: no rule is ranked here;
# frontier_w3a3.sh is the stress that passes. --tables-only: from the committed summaries.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" != "--tables-only" ]; then
  bash scripts/setup_env.sh
  .venv/bin/megatron-gnmr prepare-data
  .venv/bin/megatron-gnmr reproduce frontier_w4a4
fi
.venv/bin/megatron-gnmr compare-frontier frontier_w4a4
