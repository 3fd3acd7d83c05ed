#!/usr/bin/env bash
# Issue 31: the budget-quality frontier on the W8A2 forward-quantizing stress (docs/results.md
# section 12); about 1.5 CPU-hours on 2 cores. --tables-only rebuilds the table and plot from
# the committed per-run summaries (docs/runs/frontier_w8a2/).
set -euo pipefail
exec bash "$(dirname "$0")/frontier.sh" frontier_w8a2 w8a2 "$@"
