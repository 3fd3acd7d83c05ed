"""LoRA fine-tuning on megatron-core: adapters in Megatron-Bridge's layout, a frozen base
(any precision recipe), adapter-only checkpoints that point at their base, and merging."""
