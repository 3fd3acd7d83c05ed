#!/usr/bin/env bash
# Reproduce the combined_faults scenario (add --smoke for the one-minute size).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/megatron-gnmr reproduce combined_faults "$@"
