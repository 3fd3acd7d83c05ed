#!/usr/bin/env bash
# Compare the alarm detectors (trend model, reference band, online band, trend on a linear
# axis) on the attention- and router-fault scenarios; runs both scenarios first if their
# results are not there yet (an interrupted reproduction resumes). Tables in
# results/{attention_fault,router_fault}/alarms.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
for scenario in attention_fault router_fault; do
    .venv/bin/megatron-gnmr reproduce "$scenario" "$@"
    .venv/bin/megatron-gnmr compare-alarms "$scenario" "$@"
done
