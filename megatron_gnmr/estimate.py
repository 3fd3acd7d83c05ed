"""`megatron-gnmr estimate-memory`: the memory per GPU of a layout and the size of its
checkpoints, before a launch.

    megatron-gnmr estimate-memory --world-size 64 --config configs/llama2_7b.yaml [flags]

The same estimate the training run prints at its start (`training/memory_estimate.py`),
with the layout checked as a launch of that size would check it.
"""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, required=True,
                        help="GPUs in the launch (nodes x GPUs per node)")
    # Every other flag is pretrain_llama.py's (--config, layout, batch sizes, ...).
    parser.usage = "megatron-gnmr estimate-memory --world-size N [pretrain_llama.py flags]"
    parser.set_defaults(flags=[])


def run(args) -> None:
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.errors import UserError
    from megatron_gnmr.checkpoints import size as checkpoint_size
    from megatron_gnmr.training.memory_estimate import estimate
    from megatron_gnmr.validation import validate_layout, validate_model, validate_scale_features

    if args.world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {args.world_size}")
    config = parse_config(args.flags, world_size=args.world_size)
    validate_model(config)
    validate_layout(config, args.world_size)
    validate_scale_features(config)
    print("\n".join([*estimate(config, args.world_size).lines(),
                     *checkpoint_size.lines(config, args.world_size)]))
