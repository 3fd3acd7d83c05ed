"""The lm-eval tasks shipped with megatron-gnmr (YAML, items, the loader lm-eval imports by
path): found by `evaluate --lm-eval` and by lm-eval with --include_path on this folder."""
