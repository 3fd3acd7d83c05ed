#!/usr/bin/env bash
# The air-gapped install, end to end (issue 32): build a wheelhouse here (torch left out: the
# target brings its own), then on a fresh venv that has only torch, with every index and the
# network cut off (no index, a dead proxy): setup_env.sh from the wheelhouse, prepare-data
# from its corpus archive, three training steps. Then the install broken on purpose: a
# requirement removed must fail the install check by name, and a pip failure must stop
# setup_env.sh with pip's message and no "installed" stamp. About 3 minutes; run by
# scripts/run_tests.sh (the test command). Prints the wheelhouse's size.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "offline install: building the wheelhouse in $work/wh"
.venv/bin/python scripts/wheelhouse.py "$work/wh" | tail -n 2
python3 -m venv "$work/venv"
echo "offline install: the target's own torch (as a cluster's container brings it)"
"$work/venv/bin/python" -m pip install --quiet "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
offline=(env PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/simple http_proxy=http://127.0.0.1:9
         https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9
         WHEELHOUSE="$work/wh")
"${offline[@]}" VENV="$work/venv" bash scripts/setup_env.sh
test -f "$work/venv/.megatron-gnmr-installed"
"${offline[@]}" "$work/venv/bin/megatron-gnmr" prepare-data --data-cache-dir "$work/cache"
"${offline[@]}" OMP_NUM_THREADS=1 "$work/venv/bin/python" pretrain_llama.py --num-layers 2 \
  --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-query-groups 2 \
  --seq-length 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 3 --lr-warmup-iters 1 \
  --eval-interval 3 --eval-iters 1 --log-interval 1 --data-cache-dir "$work/cache" \
  --save "$work/run" > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
grep -q '"steps": 3' "$work/run/metrics.jsonl"
echo "offline install: trained 3 steps from the carried data with no network"

echo "offline install: breaking it on purpose"
"$work/venv/bin/python" -m pip uninstall --quiet --yes sentencepiece
if (cd / && "$work/venv/bin/python" -m megatron_gnmr.platform.install_check \
      --bin "$work/venv/bin" > "$work/check.log" 2>&1); then
  echo "offline install: FAILED: the install check passed without sentencepiece" >&2; exit 1
fi
grep -q "PROBLEM: sentencepiece" "$work/check.log"
if "${offline[@]}" WHEELHOUSE= VENV="$work/venv2" bash scripts/setup_env.sh > "$work/setup2.log" 2>&1; then
  echo "offline install: FAILED: setup_env.sh passed with no index" >&2; exit 1
fi
grep -q "failed (pip's message above)" "$work/setup2.log"
test ! -f "$work/venv2/.megatron-gnmr-installed"
echo "offline install: passed (a missing requirement and a pip failure are both refused)"
