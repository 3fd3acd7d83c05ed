#!/usr/bin/env bash
# Issue 41: the comparisons across layouts, kernels and thread counts, run again under other
# CPU kernels on the machine you have, one line per setting:
#   ATEN_CPU_CAPABILITY=default|avx2   torch's CPU kernels without AVX-512 / without any SIMD
#   ONEDNN_MAX_CPU_ISA=AVX2            oneDNN's GEMMs and convolutions without AVX-512/AMX
#   OMP_NUM_THREADS=1|2                in-process tests' intra-op threads (the launched
#                                      processes of tests/distributed always run one thread)
# Usage: bash scripts/test_kernel_variations.sh [pytest paths]   (default: the files whose
# comparisons are of quantized paths across layouts, kernels or threads)
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
  TESTS=(tests/distributed/test_precision_tp.py tests/test_precision_paths.py
         tests/test_signals_live.py)
fi
SETTINGS=("ATEN_CPU_CAPABILITY=avx2" "ATEN_CPU_CAPABILITY=default"
          "ONEDNN_MAX_CPU_ISA=AVX2" "OMP_NUM_THREADS=1" "OMP_NUM_THREADS=2")
echo "kernel variations on: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for setting in "${SETTINGS[@]}"; do
  result=$(env "$setting" .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 \
             --dist loadfile "${TESTS[@]}" 2>&1 | grep -E "passed|failed|error" | tail -1)
  echo "$setting: $result"
done
