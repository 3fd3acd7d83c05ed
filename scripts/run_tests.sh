#!/usr/bin/env bash
# One command: install everything, prepare the test data, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
exec .venv/bin/python -m pytest tests -q "$@"
