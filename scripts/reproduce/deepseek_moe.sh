#!/usr/bin/env bash
# The DeepSeek-style MoE pipeline at quickstart size (configs/deepseek_tiny_cpu.yaml: DeepSeek's
# multi-latent attention, a dense first layer, 8 fine-grained routed experts + a shared
# expert, sigmoid routing with the expert bias, EP=2 on 2 processes, the deepseek recipe with
# tokens quantized before the dispatch, GNMR and both monitors), beside the same model all on
# the low path (no controller) and in full precision. ~10 minutes on 2 cores; a finished run is kept.
# Results in results/deepseek_moe/ (one run directory each, report.png; the report prints
# the share of unit-steps each kind of unit spent on the recovery path).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
OUT=results/deepseek_moe
train() {  # NAME FLAGS...
  local name=$1; shift
  if [[ -f "$OUT/$name/summary.json" ]]; then echo "$name: done"; return; fi
  rm -rf "${OUT:?}/$name"
  OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 pretrain_llama.py \
    --config configs/deepseek_tiny_cpu.yaml --save "$OUT/$name" "$@"
}
train gnmr
train all-low --no-gnmr
train full-precision --no-gnmr --precision-recipe none --no-moe-dispatch-quant
.venv/bin/megatron-gnmr report "$OUT/gnmr" "$OUT/all-low" "$OUT/full-precision" \
  --out "$OUT/report.png"
