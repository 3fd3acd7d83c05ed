"""megatron-gnmr: low-precision LLaMA pretraining on megatron-core with the GNMR controller.

Install with `bash scripts/setup_env.sh`: on a CPU machine it installs the CPU torch wheel
first so that no requirement here can pull a multi-GB CUDA torch; in an NGC PyTorch container
(GPU clusters) it reuses the container's torch, Transformer Engine and apex and pins them.
"""

import os

from setuptools import find_packages, setup

# The megatron-core releases this code is tested against, and nothing else
# (docs/guide/training-and-checkpoints.md, "Tested versions"). megatron-core >= 0.17 declares Python >= 3.12, so 3.11 gets 0.16.1; 3.12 gets
# the tested range up to the newest release (0.19.2, run in CI by
# scripts/test_newest_megatron.sh). MEGATRON_GNMR_MEGATRON_CORE replaces the requirement
# (that script uses it to install the newest release on Python 3.11).
MEGATRON = [os.environ["MEGATRON_GNMR_MEGATRON_CORE"]] if os.environ.get(
    "MEGATRON_GNMR_MEGATRON_CORE") else ["megatron-core==0.16.1; python_version < '3.12'",
                                         "megatron-core>=0.16.1,<0.20; python_version >= '3.12'"]
# Transformer Engine: on 3.11, megatron-core 0.16.1's own bound (its metadata: >=2.9.0a0,
# <2.12.0); on 3.12, megatron-core 0.19.2 declares TE with no bound, so ours is the newest
# release our TE surface was read in (te_backend.py, capabilities.py, torch_dist/te_extra_state.py:
# 2.9, 2.11, 2.18 and the 2.19.0 / 2.20.2 release wheels). Never run on a GPU yet. No binary
# transformer-engine-torch exists: this extra compiles it (in an NGC container, use its TE).
TRANSFORMER_ENGINE = ["transformer-engine[pytorch]>=2.9,<2.12; python_version < '3.12'",
                      "transformer-engine[pytorch]>=2.9,<2.21; python_version >= '3.12'"]
TORCHAO = "torchao>=0.16,<0.19"
# The lm-eval-harness line whose model API (TemplateLM) evaluation/lm_eval_model.py was read at.
LM_EVAL = "lm-eval>=0.4.9,<0.5"

setup(
    name="megatron-gnmr",
    version="0.1.0",
    description="LLaMA pretraining on megatron-core with a per-operator precision controller",
    packages=find_packages(include=["megatron_gnmr", "megatron_gnmr.*"]),
    py_modules=["pretrain_llama"],
    # Data files the code reads beside itself (the Megatron-LM flag table; the shipped
    # lm-eval tasks: YAML, items, loader).
    package_data={"megatron_gnmr": ["**/*.json", "evaluation/lm_eval_tasks/*"]},
    python_requires=">=3.10",
    install_requires=[
        # The model, schedules, DDP, optimizer, datasets: everything a Megatron run needs.
        *MEGATRON,
        # Any torch megatron-core supports; install it first (see setup_env.sh) so this
        # range never pulls a CUDA build on a CPU machine.
        "torch>=2.4",
        "numpy",
        # YAML run configs.
        "pyyaml",
        # The BPE tokenizer trained on the prepared corpus (exact round trips), and Megatron-LM's
        # SentencePiece tokenizer types.
        "sentencepiece",
        # Hugging Face tokenizers (--tokenizer-type HuggingFaceTokenizer: tokenizer.json) and
        # GPT-2's BPE (GPT2BPETokenizer), read from local files with the library transformers'
        # fast tokenizers run on (a small compiled wheel; transformers itself is not needed).
        "tokenizers>=0.20",
        # megatron-core's dist_checkpointing (the default --ckpt-format torch_dist) imports it
        # to size its writer processes, but megatron-core does not declare it.
        "psutil",
        # export-hf / import-hf: Hugging Face checkpoints as safetensors files, the format
        # that holds tensors and nothing else (no pickle to run on load).
        "safetensors>=0.4",
        # Progress bars for data preparation and replay.
        "tqdm",
        # Dashboards are part of every run, not an option: W&B (offline by default, ~20 s to
        # install, nothing runs unless --wandb-project is given), TensorBoard event files,
        # and matplotlib for `megatron-gnmr report` and the images logged to both.
        "wandb>=0.19",
        "tensorboard>=2.15",
        # `megatron-gnmr dashboard`: the product's W&B workspace as code (W&B's own library;
        # small, pure Python, on top of wandb and pydantic).
        "wandb-workspaces>=0.4",
        "matplotlib>=3.7",
    ],
    extras_require={
        # Tests: pytest, hypothesis for the policy's property tests,
        # and ml_dtypes, the bit-exact reference for the emulated number formats.
        # torchao: the fp8-torchao recipe's tests run on the CPU too.
        # pytest-xdist runs the suite on both cores.
        # transformers: the outside judge of our LLaMA (export-hf's output must give
        # transformers' logits; a transformers model imported must give ours); peft, the judge
        # of export-hf --adapter (its LoRA over the exported base must give the merged run).
        # The CPU torch is installed first, so neither pulls a CUDA build.
        # lm-eval: its HF model is the judge of `evaluate --lm-eval` (same task, same numbers
        # through transformers on the export).
        "dev": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "ml_dtypes>=0.5", TORCHAO,
                "transformers>=5", "peft>=0.17", LM_EVAL],
        # `megatron-gnmr evaluate --lm-eval`: lm-eval-harness's tasks over our own forward.
        "eval": [LM_EVAL],
        # Transformer Engine FP8 on GPU (use the NGC container's TE where possible).
        "te": TRANSFORMER_ENGINE,
        # Real FP8 GEMMs without Transformer Engine (--precision-recipe fp8-torchao). Its
        # float8 internals were read at these versions (precision/torchao_compat.py).
        "torchao": [TORCHAO],
    },
    entry_points={"console_scripts": ["megatron-gnmr=megatron_gnmr.cli:main"]},
)
