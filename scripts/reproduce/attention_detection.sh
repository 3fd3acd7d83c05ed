#!/usr/bin/env bash
# Issue 48, the detection study. The training round (seeds 1-8: the twin and the healthy run
# of each, every detector's quantity measured, no control) and the choice made on its traces;
# with --held-out, the held-out round (seeds 101-116: twin, healthy, exact attention, the
# chosen rule, TE's rule at its tuned threshold) judged by compare-held-out. About 8 minutes
# of one core per run on an AMD EPYC; two at a time; an interrupted round resumes. Results in
# results/SCENARIO/; the summaries and traces the repository keeps in docs/runs/SCENARIO/.
# Extra arguments (--seeds, --variants, --smoke) go to reproduce.
set -euo pipefail
cd "$(dirname "$0")/../.."
scenario=attention_detection
if [ "${1:-}" = "--held-out" ]; then
  scenario=attention_detection_heldout
  shift
fi
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
.venv/bin/megatron-gnmr reproduce "$scenario" "$@"
if [ "${1:-}" != "--smoke" ]; then
  if [ "$scenario" = attention_detection ]; then
    .venv/bin/megatron-gnmr compare-detectors attention_detection
  else
    .venv/bin/megatron-gnmr compare-held-out attention_detection_heldout
  fi
fi
