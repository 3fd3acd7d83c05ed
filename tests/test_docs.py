"""The README and docs/guide cannot rot: every `megatron-gnmr` subcommand they name exists,
every flag they name is one the code knows (a command line's flags, the parser of the command
they are given to), every relative link resolves, no page of docs/ points outside the
repository (a clone does not have it), and every command block marked as runnable
on the CPU (a fence ```bash cpu) runs here. Blocks fenced ```bash gpu are named GPU-only (their
names and flags are still checked); the others run on a CPU but take longer than a test
should (a training run), and their parts are exercised by the suite's own runs.

Each check is shown failing on a planted defect: a dead link, a misspelled flag and a link
out of the repository."""

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
SPEC = REPO / "docs" / "spec.md"
# every Markdown page a clone carries (the run records under docs/runs/ are data, not pages)
DOCUMENTS = sorted({*PAGES, *(REPO / "docs").glob("*.md")})
FENCE = re.compile(r"^```(\w*)[ \t]*(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# a flag, not a family of them (`--lr-decay-*`)
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][a-zA-Z0-9_-]*[a-zA-Z0-9])(?![\w*-])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# flags of the tools the pages show around ours (torchrun, Slurm, pip, wandb, pytest, python,
# lm-eval)
OTHER_TOOLS = {"--log_samples",
               "--nproc_per_node", "--nnodes", "--standalone", "--max-restarts", "--rdzv_backend",
               "--rdzv_endpoint", "--rdzv_id", "--node_rank", "--master_addr", "--master_port",
               "--nodes", "--signal", "--requeue", "--overlap", "--ntasks-per-node",
               "--gpus-per-node",
               "--kill-on-bad-exit", "--time", "--gres", "--no-index", "--find-links",
               "--system-site-packages", "--dist", "--durations", "--summary",
               "--entity", "--project", "--from-spec", "--offline", "--help",
               "--ignore-requires-python", "--no-deps", "--no-build-isolation", "-m"}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """megatron-gnmr's own parsers, by subcommand name."""
    from megatron_gnmr.cli import build_parser, subcommands

    return subcommands(build_parser())


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _pretrain_flags() -> set[str]:
    from megatron_gnmr.arguments import build_parser
    from megatron_gnmr.interop.megatron_flags import inventory

    return _flags_of(build_parser()) | set(inventory())


def _script_flags() -> set[str]:
    """Flags our scripts declare (scripts/*.py's argparse, the shell scripts' own tests of
    their first argument such as `[ "${1:-}" = "--smoke" ]` or a case arm `--fast|--heavy)`)."""
    found = set()
    for path in (REPO / "scripts").rglob("*.py"):
        found |= set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text()))
    for path in (REPO / "scripts").rglob("*.sh"):
        text = path.read_text()
        found |= set(re.findall(r"\$\{?1[^ ]*\s*=\s*\"(--[a-z0-9-]+)\"", text))
        for arm in re.findall(r"^\s*(--[a-z0-9|-]+)\)", text, flags=re.M):
            found |= set(arm.split("|"))
    return found


def known_flags() -> set[str]:
    flags = _pretrain_flags() | _script_flags() | OTHER_TOOLS
    for parser in _subcommands().values():
        flags |= _flags_of(parser)
    return flags


def _commands(block: str) -> list[str]:
    """A shell block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def problems(text: str, page: Path) -> list[str]:
    """Everything on one page that names what does not exist."""
    parsers, known, pretrain = _subcommands(), known_flags(), _pretrain_flags()
    out = []
    code = [m.group(3) for m in FENCE.finditer(text)] + INLINE.findall(text)
    for snippet in code:
        for command in _commands(snippet):
            for name in re.findall(r"megatron-gnmr\s+([a-z][a-z-]*)", command):
                if name not in parsers:
                    out.append(f"{page.name}: no subcommand `megatron-gnmr {name}`")
            sub = re.search(r"megatron-gnmr\s+([a-z][a-z-]*)(.*)", command)
            if sub and sub.group(1) in parsers:
                # estimate-memory passes pretrain's flags on; megatron-flags classifies them
                allowed = _flags_of(parsers[sub.group(1)]) | (
                    pretrain if sub.group(1) in ("estimate-memory", "megatron-flags") else set())
                out += [f"{page.name}: `megatron-gnmr {sub.group(1)}` has no flag {flag}"
                        for flag in FLAG.findall(sub.group(2).split("|")[0])
                        if flag not in allowed and flag not in OTHER_TOOLS]
            elif "pretrain_llama.py" in command:
                tail = command.split("pretrain_llama.py", 1)[1]
                out += [f"{page.name}: pretrain_llama.py has no flag {flag}"
                        for flag in FLAG.findall(tail) if flag not in pretrain]
    for flag in set(FLAG.findall(" ".join(code))):
        if flag not in known:
            out.append(f"{page.name}: no flag {flag} anywhere")
    for target in LINK.findall(text):
        if "://" not in target and not (page.parent / target).exists():
            out.append(f"{page.name}: dead link {target}")
    return sorted(set(out))


def outside_the_repository(text: str, page: Path) -> list[str]:
    """Links, and paths quoted as code that climb out of their page's folder (`../x`), that
    resolve outside the repository: a clone does not have them (the README cited
    `../shared/SPEC.md`, the specification's copy on the machine it was written on)."""
    root = REPO.resolve()
    climbing = [span for span in INLINE.findall(text) if span.startswith("../")]
    out = []
    for target in [*LINK.findall(text), *climbing]:
        resolved = (page.parent / target).resolve()
        if "://" not in target and resolved != root and root not in resolved.parents:
            out.append(f"{page.name}: {target} is outside the repository")
    return sorted(set(out))


@pytest.mark.parametrize("page", [*PAGES, SPEC], ids=[p.name for p in [*PAGES, SPEC]])
def test_every_name_flag_and_link_exists(page):
    assert problems(page.read_text(), page) == []


@pytest.mark.parametrize("page", DOCUMENTS, ids=[str(p.relative_to(REPO)) for p in DOCUMENTS])
def test_no_page_points_outside_the_repository(page):
    assert outside_the_repository(page.read_text(), page) == []


def test_the_readme_links_the_specification():
    assert "](docs/spec.md)" in (REPO / "README.md").read_text()


def test_the_guide_is_linked_and_every_page_starts_with_a_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"docs/guide/{page.name}" in readme, page.name
            first = next(m for m in FENCE.finditer(page.read_text()))
            before = page.read_text()[:first.start()]
            assert before.count("\n\n") <= 1, f"{page.name} does not start with its command"


def test_a_dead_link_and_a_misspelled_flag_are_found():
    page = REPO / "docs" / "guide" / "controller.md"
    text = page.read_text()
    planted = text.replace("--gnmr-max-o 2", "--gnmr-max-0 2", 1) + \
        "\n[gone](no_such_page.md)\n"
    found = problems(planted, page)
    assert f"{page.name}: pretrain_llama.py has no flag --gnmr-max-0" in found
    assert f"{page.name}: dead link no_such_page.md" in found
    readme = REPO / "README.md"
    planted = readme.read_text() + "\n[spec](../shared/SPEC.md) `../shared/SPEC.md` " \
        "[spec](/work/shared/SPEC.md)\n"
    assert outside_the_repository(planted, readme) == [
        "README.md: ../shared/SPEC.md is outside the repository",
        "README.md: /work/shared/SPEC.md is outside the repository"]
    assert problems(text.replace("megatron-gnmr replay", "megatron-gnmr replya", 1), page) \
        and "no subcommand `megatron-gnmr replya`" in " ".join(
            problems(text.replace("megatron-gnmr replay", "megatron-gnmr replya", 1), page))


def _cpu_blocks():
    return [(page, m.group(3)) for page in PAGES for m in FENCE.finditer(page.read_text())
            if m.group(1) == "bash" and m.group(2) == "cpu"]


@pytest.mark.parametrize("page,block", _cpu_blocks(),
                         ids=[f"{p.name}-{i}" for i, (p, _) in enumerate(_cpu_blocks())])
def test_a_cpu_block_runs(page, block):
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{page.name}:\n{block}\n{result.stderr[-2000:]}"


def flag_table_problems(page: str) -> list[str]:
    """Where docs/guide/from-megatron-lm.md's table of Megatron-LM flags differs from
    `megatron-gnmr megatron-flags`'s output, row by row, and its count from the rules'."""
    from megatron_gnmr.flag_table import table
    from megatron_gnmr.interop.megatron_flags import RULES

    shown = re.search(r"<details><summary>the table \((\d+) flags\)</summary>\n\n(.*?)\n\n"
                      r"</details>", page, re.S)
    if not shown:
        return ["the guide's table is missing"]
    rows = lambda text: {line.split("|")[1].strip(): line for line in text.strip().splitlines()}
    guide, code = rows(shown.group(2)), rows(table(list(RULES)))
    problems = [f"{flag}: the guide has {guide.get(flag)!r}, the code prints {code.get(flag)!r}"
                for flag in sorted(guide.keys() | code.keys()) if guide.get(flag) != code.get(flag)]
    if int(shown.group(1)) != len(RULES):
        problems.append(f"the guide counts {shown.group(1)} flags, the rules hold {len(RULES)}")
    return problems


def test_the_guides_flag_table_is_the_one_the_code_prints():
    """docs/guide/from-megatron-lm.md's table of Megatron-LM flags is `megatron-gnmr
    megatron-flags`'s output: a flag moved from refused to works (or a reason changed) in
    interop/megatron_flags.py shows in the guide, or this fails until it is regenerated. (What
    each class means is held to the parsers and the validation by test_megatron_flags.py.)"""
    assert flag_table_problems((REPO / "docs" / "guide" / "from-megatron-lm.md").read_text()) \
        == []


def test_a_stale_flag_table_is_found():
    """The table check, on planted drift: a flag's class changed, a row dropped, the count."""
    page = (REPO / "docs" / "guide" / "from-megatron-lm.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `--") and
               "| works |" in line)
    flag = row.split("|")[1].strip()
    assert [p.split(":")[0] for p in flag_table_problems(
        page.replace(row, row.replace("| works |", "| refused |")))] == [flag]
    assert [p.split(":")[0] for p in flag_table_problems(page.replace(row + "\n", ""))] == [flag]
    count = re.search(r"the table \((\d+) flags\)", page).group(1)
    assert flag_table_problems(page.replace(f"the table ({count} flags)",
                                            f"the table ({int(count) + 1} flags)")) == \
        [f"the guide counts {int(count) + 1} flags, the rules hold {count}"]
