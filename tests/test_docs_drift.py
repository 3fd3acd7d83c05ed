"""The guide against the code where the code can say it (issue 60 item 7): the YAML sections
the training guide lists are the run config's, the number of bad inputs it says are tested is
the number tests/test_bad_input.py runs, the heavy tier's size the testing guide gives is what
pytest collects, a pointer to a guide section names a section that exists, and a page that
promises "the table below" has one below."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from megatron_gnmr.config import RunConfig
from tests import test_bad_input

REPO = Path(__file__).resolve().parents[1]
TRAINING = REPO / "docs" / "guide" / "training-and-checkpoints.md"


def _text(path: Path) -> str:
    return " ".join(path.read_text().split())  # one line: sentences wrap anywhere


def test_the_yaml_sections_the_guide_lists_are_the_run_configs():
    listed = re.search(r"has the sections ((?:`\w+`,? (?:and )?)+)", _text(TRAINING))
    assert listed, "the training guide no longer lists the YAML sections"
    named = re.findall(r"`(\w+)`", listed.group(1))
    assert named == [f.name for f in dataclasses.fields(RunConfig)]


def test_the_count_of_tested_bad_inputs_is_the_tables():
    said = re.search(r"\((\d+) such inputs are tested", _text(TRAINING))
    assert said, "the training guide no longer says how many bad inputs are tested"
    tested = len(test_bad_input.IN_PROCESS) + len(test_bad_input.THROUGH_THE_ENTRY_POINT) + \
        len(test_bad_input.END_TO_END)
    assert int(said.group(1)) == tested


def test_the_heavy_tiers_size_is_what_pytest_collects():
    said = re.search(r"holds (\d+) tests", _text(REPO / "docs" / "guide" / "testing.md"))
    assert said, "the testing guide no longer says how many tests the heavy tier holds"
    collected = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "--collect-only",
                                "-m", "heavy", "-p", "no:cacheprovider"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    assert said.group(1) == re.search(r"(\d+)/\d+ tests collected", collected).group(1)


def _headings(path: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in path.read_text().splitlines()
            if line.startswith("#")}


def test_pointers_to_a_guide_section_name_one_that_exists():
    pointers = []
    for path in [REPO / "setup.py", *REPO.glob("megatron_gnmr/**/*.py"), *REPO.glob("docs/**/*.md")]:
        for page, section in re.findall(r"\(?((?:docs/)?[\w/.-]+\.md), \"([^\"]+)\"\)",
                                        _text(path)):
            target = REPO / page if (REPO / page).is_file() else REPO / "docs" / "guide" / page
            pointers.append((path.name, page, section))
            assert target.is_file(), (path, page)
            # a pointer may name a heading by its start
            assert any(h.startswith(section) for h in _headings(target)), (path, page, section)
    assert pointers  # setup.py points to "Tested versions" at least


def test_a_table_promised_below_follows():
    for path in [*REPO.glob("docs/**/*.md"), REPO / "README.md"]:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if re.search(r"the table below|table below", line):
                following = lines[number + 1:number + 30]
                assert any(l.lstrip().startswith("|") for l in following), (path, number + 1)
