"""gpu_check parts (b) and (c) as rows: whether FP8 pays against its own BF16 baseline, and
what the controller costs, from measured step times (pure arithmetic: tested on the CPU).

The goals are issue 59's: FP8 at least 1.2x the tokens/s of the BF16 arm it is compared with
(te-fp8 against `te`, Transformer Engine's layers in BF16; fp8-torchao against megatron's
BF16 layers under the same compilation), and the controller's step within 1% of the step
without it. In the CPU smoke run nothing is judged: a CPU's FP8 GEMM says nothing about a
GPU's.
"""

from __future__ import annotations

import statistics

from megatron_gnmr.gpu_check.table import Row, info, judged

FP8_PAYS_AT = 1.2  # FP8 tokens/s over its BF16 arm's
CONTROLLER_WITHIN = 0.01  # the controller's step over the step without it, minus one
LOSS_TOLERANCE = 0.03  # relative to the group's BF16 arm, mean of the last steps


def fp8_pays_check(fp8: str, bf16: str) -> str:
    return f"{fp8} against {bf16}: tokens/s"


def controller_checks(on: str, off: str) -> list[str]:
    return [f"step with the controller ({on}) against without ({off})",
            "the controller's own per-step work"]


def loss_check(arm: str, reference: str) -> str:
    return f"{arm} trains like {reference}"


def _row(part: str, check: str, result: str, ok: bool, judge: bool) -> Row:
    return judged(part, check, result, ok) if judge else info(part, check, result + " (smoke: "
                                                                                "not judged)")


def fp8_pays_row(part: str, fp8: str, bf16: str, tokens_per_step: int, fp8_seconds: list[float],
                 bf16_seconds: list[float], judge: bool = True) -> Row:
    """Tokens/s (median step) of the FP8 arm against its BF16 arm's."""
    fp8_rate = tokens_per_step / statistics.median(fp8_seconds)
    bf16_rate = tokens_per_step / statistics.median(bf16_seconds)
    ratio = fp8_rate / bf16_rate
    return _row(part, fp8_pays_check(fp8, bf16),
                f"{fp8_rate:,.0f} against {bf16_rate:,.0f}: x{ratio:.2f} (goal x{FP8_PAYS_AT:.2f})",
                ratio >= FP8_PAYS_AT, judge)


def controller_rows(part: str, on: str, off: str, on_seconds: list[float],
                    off_seconds: list[float], on_work: list[float], off_work: list[float],
                    judge: bool = True) -> list[Row]:
    """The controller's share of the step: the whole step with it against without it (median
    step times of the side-by-side run), and its own per-step work (after backward and the
    decision, CUDA-synchronised timers) against what the step does there without it
    (`PlainStep`: megatron's gradient preparation, norm and clipping)."""
    on_step, off_step = statistics.median(on_seconds), statistics.median(off_seconds)
    slower = on_step / off_step - 1
    own, plain = statistics.median(on_work), statistics.median(off_work)
    share = (own - plain) / on_step
    checks = controller_checks(on, off)
    return [
        _row(part, checks[0],
             f"{on_step * 1e3:.1f} ms against {off_step * 1e3:.1f} ms: {slower:+.2%} "
             f"(goal within {CONTROLLER_WITHIN:.0%})", slower <= CONTROLLER_WITHIN, judge),
        _row(part, checks[1],
             f"{own * 1e3:.2f} ms (statistics, decision, clipping) against {plain * 1e3:.2f} "
             f"ms without it: {share:+.2%} of the step (goal within {CONTROLLER_WITHIN:.0%})",
             share <= CONTROLLER_WITHIN, judge),
    ]


def loss_row(part: str, arm: str, reference: str, losses: list[float],
             reference_losses: list[float], tail: int = 10) -> Row:
    """The arm trains: its mean loss over the last `tail` steps within LOSS_TOLERANCE of its
    group's BF16 arm's (trained side by side from the same seed)."""
    tail = max(1, min(tail, len(losses), len(reference_losses)))
    loss = statistics.mean(losses[-tail:])
    want = statistics.mean(reference_losses[-tail:])
    within = abs(loss - want) <= LOSS_TOLERANCE * abs(want)
    return judged(part, loss_check(arm, reference),
                  f"loss {loss:.4f} against {want:.4f} (mean of the last {tail} steps; "
                  f"tolerance {LOSS_TOLERANCE:.0%})", within)
