#!/usr/bin/env bash
# One command: install everything, prepare the test data, run the whole test suite.
# On a GPU machine (an NGC container) the venv reuses the container's torch and Transformer
# Engine (scripts/setup_env.sh), so tests/gpu runs; the report header says whether it does,
# and every skipped test is listed with its reason (-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/python -m pytest tests -q -rs "$@"
