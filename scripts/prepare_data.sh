#!/usr/bin/env bash
# Fetch the Shakespeare corpus (or your --input files), train the tokenizer, write .bin/.idx.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/megatron-gnmr prepare-data "$@"
