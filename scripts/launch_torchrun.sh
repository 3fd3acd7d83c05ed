#!/usr/bin/env bash
# Single node: one process per GPU (or NPROC processes on CPU).
#   NPROC=8 bash scripts/launch_torchrun.sh --config configs/llama2_1b.yaml --gnmr --save runs/1b
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${NPROC:-}" ]; then
  NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c GPU || true)
  [ "$NPROC" -gt 0 ] || NPROC=2
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron TP overlap
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" pretrain_llama.py "$@"
