#!/usr/bin/env bash
# One command: install, prepare data, train the tiny LLaMA with 2 processes (TP=2) with
# emulated FP8 under the GNMR controller and the attention monitor, render the report, and
# say where the results are.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/quickstart}

bash scripts/setup_env.sh
.venv/bin/megatron-gnmr prepare-data
rm -rf "$RUN_DIR"
.venv/bin/torchrun --standalone --nproc_per_node=2 pretrain_llama.py \
  --config configs/tiny_cpu.yaml --tensor-model-parallel-size 2 \
  --precision-recipe fp8-emulated --gnmr --monitors attention --save "$RUN_DIR" "$@"
.venv/bin/megatron-gnmr report "$RUN_DIR"
.venv/bin/python - "$RUN_DIR" <<'PY'
import json, sys
summary = json.load(open(f"{sys.argv[1]}/summary.json"))
first, last, h = summary["initial_valid_loss"], summary["final_valid_loss"], summary["unigram_entropy"]
print()
print(f"validation loss: step 0 {first:.3f} -> step {summary['steps']} {last:.3f} "
      f"(unigram entropy of the data: {h:.3f} nats)")
print(f"GNMR: recovery sparsity {summary['gnmr/recovery_sparsity']:.2%}, "
      f"exceedance rate {summary['gnmr/exceedance_rate']:.2%}")
records = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
checks = [r for r in records if any(k.startswith("monitor/") for k in r)]
alarms = [r for r in records if r.get("event") == "alarm"]
print(f"attention monitor: {len(checks)} checks, {len(alarms)} alarms")
print(f"results in {sys.argv[1]}/: report.png (loss, GNMR scores, which units ran the "
      "recovery path when, monitor signals), metrics.jsonl, gnmr_trace.jsonl, summary.json, "
      "iter_*/ (checkpoints)")
ok = last < first and last < h
print("OK: the model learned (below step 0 and below the unigram entropy)" if ok else "NOT OK")
sys.exit(0 if ok else 1)
PY
