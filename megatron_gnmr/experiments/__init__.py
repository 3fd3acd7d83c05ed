"""Experiments: the paper's scenarios rebuilt at small scale, one command each."""
