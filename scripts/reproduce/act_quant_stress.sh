#!/usr/bin/env bash
# Reproduce the act_quant_stress scenario (add --smoke for the one-minute size).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/megatron-gnmr reproduce act_quant_stress "$@"
