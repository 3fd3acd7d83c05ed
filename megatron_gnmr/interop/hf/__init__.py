"""Hugging Face transformers formats: a model family's weights in their names (one adapter per
family), and the export-hf / import-hf commands."""
