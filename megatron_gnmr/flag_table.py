"""`megatron-gnmr megatron-flags`: the Megatron-LM flag table, as markdown (every flag with
`--all`; docs/guide/from-megatron-lm.md holds the named ones), or the class of the flags given."""

from __future__ import annotations

import argparse

from megatron_gnmr.interop.megatron_flags import RULES, inventory, rule_of

CLASSES = {"works": "works", "family": "family choice", "refused": "refused"}


def table(flags: list[str]) -> str:
    from megatron_gnmr.arguments import build_parser

    ours = frozenset(n for action in build_parser()._actions for n in action.option_strings)
    lines = ["| flag | class | meaning here |", "|---|---|---|"]
    for flag in flags:
        rule = rule_of(flag, ours)
        kind = "not a Megatron-LM flag" if rule is None else CLASSES[rule.kind]
        lines.append(f"| `{flag}` | {kind} | {rule.note if rule else ''} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("flags", nargs="*", help="flags to classify (default: the table's "
                        "named ones)")
    parser.add_argument("--all", action="store_true",
                        help="every flag of Megatron-LM's pretrain_gpt.py (874)")


def run(args: argparse.Namespace) -> None:
    flags = args.flags or (sorted(inventory()) if args.all else list(RULES))
    print(table(flags))
