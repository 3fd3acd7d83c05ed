"""gpu_check's one table: every check is a row (part, check, result, status), and the verdict.

A check that could not run is a failed row with its reason (status `CANNOT RUN`), never a
silent skip and never a line below the table that a reader may miss: the verdict counts it
as a failure and names it. A row without a pass criterion (a capability, a measurement in the
CPU smoke run) has status `-` and is not judged.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Callable

PASS, FAIL, CANNOT_RUN, INFO = "yes", "NO", "CANNOT RUN", "-"
HEADER = ("| part | check | result | ok |", "|---|---|---|---|")


@dataclass(frozen=True)
class Row:
    part: str
    """Which part of the check: capability, (a) te-fp8 recovery, (b) FP8 pays, ..."""
    check: str
    result: str
    status: str  # PASS, FAIL, CANNOT_RUN or INFO

    def line(self) -> str:
        cells = (self.part, self.check, self.result, self.status)
        return "| " + " | ".join(_cell(text) for text in cells) + " |"


def _cell(text: str) -> str:
    """One markdown cell: a `|` would split it, a newline would end the table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def judged(part: str, check: str, result: str, ok: bool) -> Row:
    return Row(part, check, result, PASS if ok else FAIL)


def info(part: str, check: str, result: str) -> Row:
    return Row(part, check, result, INFO)


def cannot_run(part: str, check: str, reason: str) -> Row:
    """A check that could not run: a failure that says why."""
    print(f"gpu_check: CANNOT RUN {part} / {check}: {reason}", file=sys.stderr)
    return Row(part, check, f"cannot run: {reason}", CANNOT_RUN)


def error_reason(error: BaseException) -> str:
    """The exception as one line (the first line of its message: enough to say why)."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}".rstrip(": ")[:300]


def rows_or_cannot_run(expected: list[tuple[str, str]],
                       produce: Callable[[], list[Row]]) -> list[Row]:
    """The rows `produce()` returns; if it raises, one CANNOT RUN row per expected (part,
    check), each with the error (its traceback goes to stderr, where a person debugging
    looks)."""
    try:
        return produce()
    except Exception as error:  # noqa: BLE001 - any failure of a check is reported, not raised
        traceback.print_exc(file=sys.stderr)
        reason = error_reason(error)
        return [cannot_run(part, check, reason) for part, check in expected]


def verdict(rows: list[Row]) -> tuple[bool, str]:
    """(every judged row passed and every check ran, the verdict line)."""
    failed = [row for row in rows if row.status == FAIL]
    not_run = [row for row in rows if row.status == CANNOT_RUN]
    if not failed and not not_run:
        judged_rows = sum(row.status == PASS for row in rows)
        return True, f"verdict: OK ({judged_rows} checks passed)"
    parts = []
    if failed:
        parts.append(f"{len(failed)} failed ({'; '.join(r.check for r in failed)})")
    if not_run:
        parts.append(f"{len(not_run)} could not run ({'; '.join(r.check for r in not_run)})")
    return False, "verdict: NOT OK: " + ", ".join(parts)


def render(title: str, notes: list[str], rows: list[Row]) -> tuple[bool, str]:
    """(ok, the markdown: a title, the notes, one table, the verdict)."""
    ok, line = verdict(rows)
    text = [f"# {title}", "", *notes, "", *HEADER, *(row.line() for row in rows), "", line]
    return ok, "\n".join(text)
