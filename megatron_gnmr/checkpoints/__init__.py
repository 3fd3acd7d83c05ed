"""Checkpoints: the formats and the files they write, and everything a run needs around them.

`formats.py` is the table (one object per `--ckpt-format`; callers ask it, never compare a
format's name); `per_rank.py` and `torch_dist/` are the two formats' files; `choice.py`
picks the newest intact checkpoint of either; `rng.py` the random streams a checkpoint
carries; `optimizer_state.py` and `safe_state.py` what a per-rank shard holds, as data;
`size.py` what a checkpoint writes and the host memory it takes; `durable.py` the
crash-safe write both formats publish with; `run_lock.py` one live job per run directory.
The trainer's side (what of the trainer goes in, and back) is `training/resume.py`.
"""
