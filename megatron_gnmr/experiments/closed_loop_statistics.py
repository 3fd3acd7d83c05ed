"""The numbers a closed-loop claim rests on: means with their standard errors, the margin
that calls a run harmed, and Fisher's exact test of one arm's failures against another's."""

from __future__ import annotations

import math
import statistics


def mean_and_standard_error(values: list[float]) -> tuple[float, float] | None:
    """(mean, standard error of the mean); the error is 0 for one value, None for none."""
    if not values:
        return None
    spread = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), spread


def harm_margin(exact_final_losses: list[float]) -> float:
    """A run ends harmed when its final loss is more than this above exact attention's of the
    same seed: twice exact attention's own seed-to-seed standard deviation (two exact runs of
    different seeds differ by that much about one time in twenty, under a normal model)."""
    return 2.0 * statistics.stdev(exact_final_losses)


def fisher_one_sided(failed_a: int, runs_a: int, failed_b: int, runs_b: int) -> float:
    """P(arm A fails at most `failed_a` of its runs | the total failures of both arms), under
    the null that both arms fail alike: Fisher's exact test that A fails LESS often than B
    (the hypergeometric lower tail)."""
    total_failed, total = failed_a + failed_b, runs_a + runs_b
    denominator = math.comb(total, total_failed)
    low = max(0, total_failed - runs_b)
    return sum(math.comb(runs_a, k) * math.comb(runs_b, total_failed - k)
               for k in range(low, failed_a + 1)) / denominator


def sign_test_one_sided(only_a_failed: int, only_b_failed: int) -> float:
    """The paired sign test (McNemar's exact form) over seeds both arms ran: of the seeds where
    exactly one arm failed, P(A is the one at most `only_a_failed` times) under the null that
    either is equally likely: the test that A fails LESS often than B, seed for seed."""
    discordant = only_a_failed + only_b_failed
    return sum(math.comb(discordant, k) for k in range(only_a_failed + 1)) / 2 ** discordant
