#!/usr/bin/env bash
# Issue 31: the budget-quality frontier on the 3-bit saved-activation stress (docs/results.md section 12);
# about 1 CPU-hour on 2 cores. --tables-only rebuilds the table and plot from the committed
# per-run summaries (docs/runs/frontier_act_quant/).
set -euo pipefail
exec bash "$(dirname "$0")/frontier.sh" frontier_act_quant act_quant "$@"
