"""`scripts/gpu_check.sh`: the one prepared check of the GPU path for a person with one GPU
(`check.py` runs it: `python -m megatron_gnmr.gpu_check.check`), a user's command rather than
one of the paper's experiments: its arms, its two groups of FP8 arms against their BF16
baselines, the recovery-path replay, the speed and controller-cost rows, the checkpoint rows
and the one table they all print into."""
