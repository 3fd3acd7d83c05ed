#!/usr/bin/env bash
# Multi-node under SLURM: one srun task per node, each starting torchrun with a c10d
# rendezvous on the first node. Submit with, for example:
#   sbatch --nodes=4 --gpus-per-node=8 scripts/launch_slurm.sh \
#       --config configs/llama2_7b.yaml --gnmr --save /shared/runs/7b
# Knobs (environment): GPUS_PER_NODE, MASTER_PORT, MAX_RESTARTS, PYTHON, NCCL_* as usual.
#SBATCH --job-name=megatron-gnmr
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}  # a lost rank restarts the job from the last checkpoint
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
echo "launch: ${SLURM_NNODES} nodes x ${GPUS_PER_NODE} GPUs, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
srun --kill-on-bad-exit=1 "$PY" -m torch.distributed.run \
  --nnodes="$SLURM_NNODES" --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --max-restarts="$MAX_RESTARTS" \
  pretrain_llama.py "$@"
