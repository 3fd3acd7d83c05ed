#!/usr/bin/env bash
# Reproduce the deepseek_hierarchy scenario (add --smoke for the one-minute size).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/megatron-gnmr reproduce deepseek_hierarchy "$@"
