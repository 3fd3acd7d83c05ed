#!/usr/bin/env bash
# Issue 56, the fault ladder's held-out round (seeds 101-116, configs/scenarios/
# attention_ladder_heldout.yaml, written from the training round's committed choice): two
# processes, odd and even seeds, each running its seeds in the order of
# experiments/ladder_held_out_runs.py (twins, exact attention and the healthy run, then the
# arms only where the twin died, the chosen arm and TE's rule with O first); then
# compare-ladder-held-out. About 9 minutes of one core per full run on an Intel Xeon, some
# 16 runs a seed, then the twins that run alone (3 a seed); an interrupted round resumes
# where it stopped. --smoke: every variant of the first seed at the smoke size, nothing
# judged. Other arguments go to both runners: `--new-seeds-for 120` on a machine lent for
# three hours begins no seed after two (a seed's runs pair only on one CPU model).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
if [ "${1:-}" = "--smoke" ]; then
  exec .venv/bin/megatron-gnmr reproduce attention_ladder_heldout --smoke
fi
.venv/bin/python -m megatron_gnmr.experiments.ladder_held_out_runs \
  --seeds 101 103 105 107 109 111 113 115 "$@" &
odd=$!
.venv/bin/python -m megatron_gnmr.experiments.ladder_held_out_runs \
  --seeds 102 104 106 108 110 112 114 116 "$@" &
even=$!
# Ctrl-C or a kill stops both (background jobs of a script ignore SIGINT on their own)
trap 'kill "$odd" "$even" 2>/dev/null' INT TERM
status=0
wait "$odd" || status=$?
wait "$even" || status=$?
if [ "$status" -ne 0 ]; then
  echo "attention_ladder_heldout: a runner failed (exit $status); rerun to resume" >&2
  exit "$status"
fi
.venv/bin/megatron-gnmr compare-ladder-held-out attention_ladder_heldout
