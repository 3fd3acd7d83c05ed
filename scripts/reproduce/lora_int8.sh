#!/usr/bin/env bash
# Issue 21 / SPEC 8.3: LoRA fine-tuning on Austen of a Shakespeare-pretrained base whose GEMMs
# run W8A8 INT8: exact base vs fixed INT8 vs GNMR INT8/BF16 vs qerr-peers INT8/BF16, 3 seeds,
# each run evaluated (held-out perplexity, 4-way cloze, retention), then the same at W4A4 (a
# stress, with static-fc2 and random baselines). The base (4 x 256, 800 steps, ~6 min) is
# pretrained once and cached; then 27 fine-tunes (~75 min on 2 cores in all; add --smoke for
# a few-minute check). Results in results/lora_int8/.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data --corpus austen --tokenizer-corpus shakespeare
exec .venv/bin/megatron-gnmr reproduce lora_int8 "$@"
