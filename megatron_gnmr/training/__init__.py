"""Training: process groups, the loop, the optimizer, and the trainer's side of its checkpoints
(`resume.py`; the formats and their files are `checkpoints/`)."""
