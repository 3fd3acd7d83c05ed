"""What a launch says once, at its start, about its Megatron-LM command line: the flags it
leaves out whose default here is not Megatron-LM's (`megatron_defaults.DIFFERENCES`), the data
it trains on without --data-path, and what its flags do on this machine
(`--distributed-backend nccl` without a GPU, `--timing-log-level`). Printed by the logging
rank (`arguments.parse_config`) before anything is built."""

from __future__ import annotations

from megatron_gnmr.interop.megatron_defaults import DIFFERENCES, theirs


def start_notices(config, given: set[str]) -> list[str]:
    """The start's lines (`given`: the flags the command line and YAML set)."""
    return [line for line in (start_notice(config, given), *on_this_machine(config, given))
            if line]


def on_this_machine(config, given: set[str]) -> list[str]:
    """What flags given for Megatron-LM's GPU clusters do here."""
    from megatron_gnmr.platform.device import has_accelerator

    lines = []
    backend = config.parallel.distributed_backend
    if "--distributed-backend" in given and backend == "nccl" and not has_accelerator():
        lines.append("--distributed-backend nccl: this machine has no GPU, so the collectives "
                     "run on gloo")
    level = config.logging.timing_log_level
    if "--timing-log-level" in given and level > 0:
        lines.append(f"--timing-log-level {level}: the step time is logged "
                     "(train/step_time_s, on every console line); Megatron-LM's finer timers "
                     f"of level {level} (forward-backward, optimizer, ...) are not taken here")
    return lines


def start_notice(config, given: set[str]) -> str | None:
    """One line: the flags absent from the launch (`given`: the flags its command line and
    YAML set, ours and Megatron-LM's) whose default here is not Megatron-LM's and matters to
    this run, each with its value here and Megatron-LM's (`megatron-gnmr megatron-flags FLAG`
    says why)."""
    from megatron_gnmr.config import SECTIONS, flag_name

    ours = {flag_name(section, name): getattr(getattr(config, section), name)
            for section in SECTIONS for name in vars(getattr(config, section))}
    parts = []
    for flag, difference in DIFFERENCES.items():
        positive = flag if flag in ours or difference.here is not None \
            else flag.replace("--no-", "--", 1)
        if flag in given or positive in given or not difference.matters(config):
            continue
        here = difference.here or f"{positive} {ours[positive]}"
        parts.append(f"{here} (Megatron-LM: {theirs(flag)})")
    data = config.data
    if not (data.data_path or data.data_args_path or data.train_data_path or
            data.per_split_data_args_path or data.mock_data):
        parts.append(f"no --data-path: the bundled corpus --corpus {config.data.corpus} "
                     "(Megatron-LM trains on mock data without it)")
    if not parts:
        return None
    return ("absent, these differ from Megatron-LM's defaults (megatron-gnmr megatron-flags "
            "FLAG says why): " + "; ".join(parts))
