"""Observability: console, JSONL (and W&B/TensorBoard) behind one logger interface."""
