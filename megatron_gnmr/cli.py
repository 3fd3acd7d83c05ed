"""`megatron-gnmr`: the project's subcommands (prepare-data, replay, report, reproduce,
compare-alarms, compare-signals, compare-closed-loop, compare-detectors, compare-held-out,
compare-ladder, compare-ladder-held-out, compare-lr-edge, compare-frontier, estimate-memory, calibrate, evaluate, merge-lora, dashboard, megatron-flags,
export-hf, import-hf)."""

from __future__ import annotations

import sys

from megatron_gnmr.errors import exits_cleanly_on_user_error


def build_parser():
    """The command-line parser with every subcommand (a subparser each, named as typed)."""
    from megatron_gnmr import calibrate, estimate
    from megatron_gnmr.arguments import OneLineErrorParser
    from megatron_gnmr.controller import replay
    from megatron_gnmr.data import prepare
    from megatron_gnmr.evaluation import command as evaluate
    from megatron_gnmr.experiments import (
        alarm_comparison,
        closed_loop,
        detection,
        frontier,
        held_out,
        ladder,
        ladder_held_out_report,
        lr_edge,
        runner,
        signal_comparison,
    )
    from megatron_gnmr import flag_table
    from megatron_gnmr.interop.hf import export as export_hf
    from megatron_gnmr.interop.hf import importer as import_hf
    from megatron_gnmr.observe import dashboard, report
    from megatron_gnmr.training import merge_lora

    parser = OneLineErrorParser(prog="megatron-gnmr", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True,
                                     parser_class=OneLineErrorParser)
    for name, module, text in (
        ("prepare-data", prepare, "fetch text, train the tokenizer, write .bin/.idx"),
        ("replay", replay, "re-run the GNMR policy on a recorded trace, for a sweep"),
        ("report", report, "render a PNG report from the JSONL logs of one or more runs"),
        ("reproduce", runner, "run one of the paper's scenarios and write its results table"),
        ("compare-alarms", alarm_comparison, "every alarm detector on a fault scenario's runs"),
        ("compare-signals", signal_comparison, "the equal-budget table of risk signals"),
        ("compare-closed-loop", closed_loop, "did the controller save the runs that die?"),
        ("compare-detectors", detection, "which alarm is early and specific, from traces"),
        ("compare-held-out", held_out, "the detection study's held-out round, judged once"),
        ("compare-ladder", ladder, "the fault ladder: lethality, the probe, detectors per rung"),
        ("compare-ladder-held-out", ladder_held_out_report, "the fault ladder's held-out "
                                                            "round, judged once"),
        ("compare-lr-edge", lr_edge, "final loss against the learning rate, per precision"),
        ("compare-frontier", frontier, "which units to keep high: the budget-quality "
                                       "frontier"),
        ("dashboard", dashboard, "the W&B workspace for a run's keys (or its offline spec)"),
        ("estimate-memory", estimate, "memory per GPU of a layout, before launching it"),
        ("calibrate", calibrate, "the units to keep in BF16, as Megatron's precision config"),
        ("evaluate", evaluate, "held-out perplexity, cloze accuracy and retention of a run"),
        ("merge-lora", merge_lora, "a LoRA run's adapters merged into its base's weights"),
        ("megatron-flags", flag_table, "how each Megatron-LM flag is read here"),
        ("export-hf", export_hf, "a run as a Hugging Face transformers model directory"),
        ("import-hf", import_hf, "a Hugging Face model (Llama, Mistral, Mixtral, DeepSeek-V3) "
                                 "as a checkpoint to fine-tune"),
    ):
        sub = commands.add_parser(name, help=text, description=text, allow_abbrev=False)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def subcommands(parser) -> dict:
    """name -> its subparser."""
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@exits_cleanly_on_user_error
def main(argv: list[str] | None = None) -> None:
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    parser = build_parser()
    # estimate-memory passes every flag it does not know on to pretrain's parser
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if hasattr(args, "flags"):
        args.flags = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.run(args)


if __name__ == "__main__":
    main()
