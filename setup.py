"""megatron-gnmr: low-precision LLaMA pretraining on megatron-core with the GNMR controller.

Install with `bash scripts/setup_env.sh` (CPU: installs the CPU torch wheel first so that no
requirement here can pull a multi-GB CUDA torch). On GPU clusters use an NGC PyTorch
container, which already has torch, Transformer Engine and apex: `pip install -e .[te]`.
"""

import sys

from setuptools import find_packages, setup

# megatron-core >= 0.17 declares Python >= 3.12; 0.16.1 is the newest for 3.11. The code
# supports both lines (0.16.1 on CPU/CI, 0.19.x on 3.12 clusters).
MEGATRON = "megatron-core==0.16.1" if sys.version_info < (3, 12) else "megatron-core>=0.16.1"
TORCHAO = "torchao>=0.16,<0.19"

setup(
    name="megatron-gnmr",
    version="0.1.0",
    description="LLaMA pretraining on megatron-core with a per-operator precision controller",
    packages=find_packages(include=["megatron_gnmr", "megatron_gnmr.*"]),
    py_modules=["pretrain_llama"],
    python_requires=">=3.10",
    install_requires=[
        # The model, schedules, DDP, optimizer, datasets: everything a Megatron run needs.
        MEGATRON,
        # Any torch megatron-core supports; install it first (see setup_env.sh) so this
        # range never pulls a CUDA build on a CPU machine.
        "torch>=2.4",
        "numpy",
        # YAML run configs.
        "pyyaml",
        # The BPE tokenizer trained on the prepared corpus (exact round trips).
        "sentencepiece",
        # Progress bars for data preparation and replay.
        "tqdm",
        # Dashboards are part of every run, not an option: W&B (offline by default, ~20 s to
        # install, nothing runs unless --wandb-project is given), TensorBoard event files,
        # and matplotlib for `megatron-gnmr report` and the images logged to both.
        "wandb>=0.19",
        "tensorboard>=2.15",
        "matplotlib>=3.7",
    ],
    extras_require={
        # Tests: pytest, hypothesis for the policy's property tests,
        # and ml_dtypes, the bit-exact reference for the emulated number formats.
        # torchao: the fp8-torchao recipe's tests run on the CPU too.
        "dev": ["pytest>=7", "hypothesis>=6", "ml_dtypes>=0.5", TORCHAO],
        # Transformer Engine FP8 on GPU (use the NGC container's TE where possible).
        "te": ["transformer-engine[pytorch]"],
        # Real FP8 GEMMs without Transformer Engine (--precision-recipe fp8-torchao). Its
        # float8 internals were read at these versions (precision/torchao_compat.py).
        "torchao": [TORCHAO],
    },
    entry_points={"console_scripts": ["megatron-gnmr=megatron_gnmr.cli:main"]},
)
