"""`torchrun --nproc_per_node N -m megatron_gnmr.evaluation RUN_DIR ...`: the evaluation of a
run written by N processes (`megatron-gnmr evaluate` is the same for one)."""

import sys

from megatron_gnmr.cli import main

main(["evaluate", *sys.argv[1:]])
