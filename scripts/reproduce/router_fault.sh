#!/usr/bin/env bash
# Reproduce the router_fault scenario on a fresh machine (add --smoke for the one-minute size);
# results in results/router_fault/ (results.md, results.json, report.png, one run dir per seed).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/megatron-gnmr reproduce router_fault "$@"
