#!/usr/bin/env bash
# Issue 31: the budget-quality frontier of one stress (frontier_act_quant or frontier_w4a4).
# 1. the calibration run: the scenario's all-low run on a seed of its own (101), measured;
# 2. `megatron-gnmr calibrate` of it at 12.5% and 25% of the units' GEMM FLOPs (all GEMMs, and
#    the weight-gradient GEMM alone) -> configs/frontier/PREFIX_calibrated_*.yaml, ranked by
#    the oracle; and, for a scenario that runs them, ranked by the first-order loss cost of
#    the forward rounding -> PREFIX_loss_calibrated_*.yaml (and with the first layer kept
#    before any ranked unit, PREFIX_first_loss_calibrated_*.yaml; committed; this step writes
#    them again);
# 3. every variant x seed (`reproduce`, two runs at a time, resumable);
# 4. `compare-frontier`: the per-run summaries, the table and the plot in docs/runs/SCENARIO/.
# Usage: scripts/reproduce/frontier.sh SCENARIO PREFIX [--tables-only]
set -euo pipefail
cd "$(dirname "$0")/../.."
scenario=$1 prefix=$2
if [ "${3:-}" = "--tables-only" ]; then  # from the committed summaries alone
  exec .venv/bin/megatron-gnmr compare-frontier "$scenario"
fi
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
calibration=results/$scenario/calibration-seed101
if [ ! -f "$calibration/summary.json" ]; then
  # shellcheck disable=SC2046  # the scenario's flags, one word each
  OMP_NUM_THREADS=1 .venv/bin/python pretrain_llama.py $(.venv/bin/python -c "
from megatron_gnmr.experiments.scenario import load_scenario
s = load_scenario('$scenario'); print(' '.join(s.base + s.variants['all-low']))") \
    --gnmr-measure qerr,oracle,loss_cost --seed 101 --save "$calibration" --resume auto
fi
for budget in 12 25; do
  share=$([ $budget = 12 ] && echo 0.125 || echo 0.25)
  .venv/bin/megatron-gnmr calibrate "$calibration" --budget $share --measure oracle \
    --out "configs/frontier/${prefix}_calibrated_$budget.yaml"
  .venv/bin/megatron-gnmr calibrate "$calibration" --budget $share --measure oracle \
    --gemms wgrad --out "configs/frontier/${prefix}_calibrated_wgrad_$budget.yaml"
  if grep -q "${prefix}_loss_calibrated_$budget" "configs/scenarios/$scenario.yaml"; then
    .venv/bin/megatron-gnmr calibrate "$calibration" --budget $share --measure loss_cost \
      --out "configs/frontier/${prefix}_loss_calibrated_$budget.yaml"
  fi
  if grep -q "${prefix}_first_loss_calibrated_$budget" "configs/scenarios/$scenario.yaml"; then
    .venv/bin/megatron-gnmr calibrate "$calibration" --budget $share --measure loss_cost \
      --first-layers 1 --out "configs/frontier/${prefix}_first_loss_calibrated_$budget.yaml"
  fi
done
.venv/bin/megatron-gnmr reproduce "$scenario"
.venv/bin/megatron-gnmr compare-frontier "$scenario"
