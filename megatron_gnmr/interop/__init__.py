"""The borders: Megatron-LM's command line (`megatron_flags.py`) and, beside it, the formats
of the tools our users come from. The core never learns them."""
