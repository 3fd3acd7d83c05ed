#!/usr/bin/env bash
# Reproduce the attention_fault scenario (add --smoke for the one-minute size).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/megatron-gnmr reproduce attention_fault "$@"
