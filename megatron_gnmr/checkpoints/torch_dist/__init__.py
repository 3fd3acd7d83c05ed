"""--ckpt-format torch_dist: megatron-core's dist_checkpointing in Megatron-LM's layout (the
files on disk, what a checkpoint holds, reading one as data only, the run's save and load)."""
