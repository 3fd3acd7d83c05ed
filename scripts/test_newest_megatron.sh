#!/usr/bin/env bash
# The second environment: the same code on the newest megatron-core release (0.19.2, what
# Python 3.12 clusters install), in .venv-newest, running the core subset: training at TP=1
# (in-process, with resume) and TP=2/DP=2/PP=2, every emulated recipe with and without the
# controller, the monitors, MoE at EP=2 (DeepSeek-style: shared experts, dispatch quantization),
# NVFP4, the precision config file, the layer-spec surgery and the CPU patches, sequence
# parallelism, recompute, the distributed optimizer's shards and overlaps, DeepSeek's
# multi-latent attention (its maps, TP=2 against TP=1, the tiny DeepSeek config), the
# torch_dist checkpoint (safety, megatron-core's own loader, a bit-exact resume at TP=2 with
# the distributed optimizer, written asynchronously, and the DP-reshardable form's refusal of
# a TP change), the cluster paths faked on the CPU (TE's FusedAdam at a resume, the tools
# without gradient buffers), Hugging Face export/import against transformers, and the
# NVTE_*_ATTN values megatron-core writes for an attention backend (read from its own method).
# megatron-core 0.19.2 asks for Python >= 3.12; on 3.11 it installs with
# --ignore-requires-python plus a numpy that still supports 3.11 and triton (one unguarded
# import in megatron/core/transformer/moe/ops/paged_stash.py). Called by run_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST=${NEWEST:-0.19.2}
# megatron-core first, alone (--ignore-requires-python must not reach any other package: it
# would pick releases that need 3.12); then the project, whose requirement it satisfies.
PRE_INSTALL="--ignore-requires-python --no-deps megatron-core==$NEWEST numpy==2.4.6 triton" \
  MEGATRON_GNMR_MEGATRON_CORE="megatron-core==$NEWEST" VENV=.venv-newest \
  bash scripts/setup_env.sh
.venv-newest/bin/python -W ignore -c "import sys, torch, megatron.core as m, numpy; print(
    f'newest megatron: python {sys.version.split()[0]}, torch {torch.__version__}, '
    f'megatron-core {m.__version__}, numpy {numpy.__version__}')"
exec .venv-newest/bin/python -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadfile \
  -o faulthandler_timeout=900 \
  tests/test_megatron_compat.py tests/test_training_in_process.py tests/test_precision_paths.py \
  tests/test_te_path.py tests/test_cpu_patches.py tests/distributed/test_precision_tp.py \
  tests/distributed/test_monitors.py tests/distributed/test_parallel_training.py \
  tests/distributed/test_grad_stats.py tests/test_memory_estimate.py \
  tests/test_moe_precision.py tests/distributed/test_moe_recipes.py \
  tests/test_precision_config_file.py tests/test_nvfp4.py tests/test_lora.py \
  tests/test_model_families.py tests/distributed/test_mla.py \
  tests/test_dist_checkpoint_safety.py tests/test_hf_interop.py tests/test_hf_families.py \
  tests/distributed/test_dist_checkpoint.py::test_a_same_layout_resume_is_bit_for_bit \
  tests/distributed/test_dist_checkpoint.py::test_a_dp_reshardable_optimizer_refuses_a_tp_change_in_one_line \
  tests/test_cluster_paths.py tests/test_attention_environment.py "$@"
