#!/usr/bin/env bash
# A SLURM job that survives its time limit and a lost node:
#
#   SAVE=/lustre/me/runs/llama-7b sbatch --nodes=2-4 scripts/launch_slurm.sh \
#       --config configs/llama2_7b.yaml --tensor-model-parallel-size 8 ...
#
# - Time limit: SLURM sends USR1 to this script 3 minutes before it (`--signal=B:USR1@180`);
#   the script passes SIGTERM to the training processes themselves (not to torchrun, which
#   would kill them 30 s later), every rank saves at the end of its current step and exits 0
#   (training/exit_signals.py), and once they have exited the job requeues itself (a requeue
#   while they save would end the job at once: SIGTERM, then SIGKILL after KillWait).
# - A lost node: SLURM requeues the job (`--requeue`); it comes back on the nodes it gets
#   (`--nodes=MIN-MAX`), and the resume reshards the torch_dist checkpoint (the default
#   format) to the new data-parallel size: keep --global-batch-size a multiple of
#   --micro-batch-size x every data-parallel size the job may come back with.
# - Every launch resumes (`--resume auto`): the first one starts the run.
# - A rank that dies while the nodes live: torchrun restarts the ranks from the last
#   checkpoint (--max-restarts=$MAX_RESTARTS) within the allocation.
# Knobs (environment): SAVE (required), GPUS_PER_NODE, PORT, MAX_RESTARTS, PYTHON, NCCL_*.
# DRY_RUN=1 prints the launch command instead of running it (tests/test_launch_slurm.py).
#
#SBATCH --job-name=megatron-gnmr
#SBATCH --nodes=2-4
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=megatron-gnmr-%j.out
set -euo pipefail

: "${SAVE:?set SAVE=the run directory (checkpoints, logs); every launch resumes from it}"
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
PYTHON=${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python )}
MAX_RESTARTS=${MAX_RESTARTS:-3}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
NODES=${SLURM_JOB_NUM_NODES:?not inside a SLURM allocation (sbatch this script)}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
# the first host; awk reads every line, so scontrol never writes into a closed pipe (under
# pipefail, head's early exit would end the script with SIGPIPE, 141)
HEAD=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | awk 'NR == 1')
PORT=${PORT:-29500}

launch=(srun --kill-on-bad-exit=0 --ntasks-per-node=1
        "$PYTHON" -m torch.distributed.run --nnodes="$NODES" --nproc_per_node="$GPUS_PER_NODE"
        --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$PORT" --rdzv_id="$SLURM_JOB_ID"
        --max-restarts="$MAX_RESTARTS" "$REPO/pretrain_llama.py" "$@" --save "$SAVE" --resume auto)

if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${launch[@]}"
  echo
  exit 0
fi

echo "launch_slurm: job $SLURM_JOB_ID on $NODES node(s) x $GPUS_PER_NODE, restart" \
     "${SLURM_RESTART_COUNT:-0}, run directory $SAVE"
requeue=
time_limit() {
  echo "launch_slurm: the time limit is near: the ranks save at the end of this step"
  # the training processes (torchrun starts them as `python -u pretrain_llama.py ...`)
  srun --overlap --ntasks-per-node=1 pkill -TERM -f -- "-u $REPO/pretrain_llama.py" || true
  requeue=1  # once they have saved and exited: a requeue ends the job at once (SIGTERM,
             # then SIGKILL after KillWait), which would cut the save short
}
trap time_limit USR1

"${launch[@]}" &
training=$!
# `wait` returns early (128 + the signal) when a trapped signal arrives: wait again until the
# launch has finished, and exit with its status
while true; do
  status=0
  wait "$training" || status=$?
  kill -0 "$training" 2>/dev/null || break
done
if [ -n "$requeue" ]; then
  echo "launch_slurm: saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
