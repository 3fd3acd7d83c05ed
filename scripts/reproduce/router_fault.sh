#!/usr/bin/env bash
# Reproduce the router_fault scenario (add --smoke for the one-minute size).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/megatron-gnmr reproduce router_fault "$@"
