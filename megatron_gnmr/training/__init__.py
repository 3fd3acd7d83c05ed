"""Training: process groups, the loop, optimizer and checkpoints."""
