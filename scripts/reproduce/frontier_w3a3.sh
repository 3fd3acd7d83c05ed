#!/usr/bin/env bash
# Issue 31: the budget-quality frontier on the W3A3 forward-quantizing stress (docs/results.md section 12);
# about 1 CPU-hour on 2 cores. --tables-only rebuilds the table and plot from the committed
# per-run summaries (docs/runs/frontier_w3a3/).
set -euo pipefail
exec bash "$(dirname "$0")/frontier.sh" frontier_w3a3 w3a3 "$@"
