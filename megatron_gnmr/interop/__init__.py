"""The borders: Megatron-LM's command line (`megatron_flags.py`) and the Hugging Face commands
(`hf/`: export-hf, import-hf, the PEFT adapter, the judge against transformers). What a
family's weights are called in transformers is the family's own knowledge and lives with it
(`model_families/*_hf.py`); the commands here ask the family for it."""
