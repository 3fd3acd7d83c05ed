#!/usr/bin/env bash
# Issue 56, the fault ladder's training round (seeds 1-8): per seed a twin per rung, the healthy
# run and exact attention, every candidate's quantity traced (the kernel probe, TE's metrics
# with and without O, GNMR's norms), then compare-ladder: each rung's lethality and every
# detector replayed on the traces. About 6 minutes of one core per run on an Intel Xeon; two
# at a time, seed by seed; an interrupted round resumes. Extra arguments (--seeds, --variants,
# --smoke) go to reproduce.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
.venv/bin/megatron-gnmr reproduce attention_ladder "$@"
if [ "${1:-}" != "--smoke" ]; then
  .venv/bin/megatron-gnmr compare-ladder attention_ladder
fi
