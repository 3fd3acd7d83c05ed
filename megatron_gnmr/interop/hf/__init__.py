"""Hugging Face transformers' side: the export-hf / import-hf commands, a LoRA run as a PEFT
adapter, and the judge that compares our logits with transformers'. Each family's weight map
(our names <-> transformers') is the family's own: `model_families/*_hf.py`."""
