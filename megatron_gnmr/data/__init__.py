"""Data: corpora from registry packages, the tokenizer, .bin/.idx files, GPTDataset."""
