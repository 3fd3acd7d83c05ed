"""Jane Austen's six novels, read out of Debian's `r-cran-janeaustenr` package.

The .deb is downloaded as a plain file from its pinned Debian pool address and checked
against its pinned sha256 (`MEGATRON_GNMR_AUSTEN_URL` points elsewhere, e.g. a mirror or
`file:///...`; the hash must match all the same). Nothing is installed or run: the novels
are the character vectors in `janeaustenr/data/Rdata.rdb`, which this module reads with the
standard library (an `ar` archive holding `data.tar.xz`; the .rdb is a sequence of
zlib-compressed R serialisations, each a STRSXP of the novel's lines).
"""

from __future__ import annotations

import io
import struct
import tarfile
import zlib
from pathlib import Path

from megatron_gnmr.data.corpus import fetched_documents
from megatron_gnmr.errors import UserError

AUSTEN_URL = ("http://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/"
              "r-cran-janeaustenr_1.0.0-1_all.deb")
AUSTEN_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
STRSXP, CHARSXP = 16, 9


def austen_documents(cache_dir: Path) -> list[str]:
    """The six novels, one document each (cached as text files after the first call)."""
    return fetched_documents(cache_dir, "austen", "the Jane Austen corpus", AUSTEN_URL,
                             "MEGATRON_GNMR_AUSTEN_URL", AUSTEN_SHA256, write_novels)


def write_novels(deb: bytes, target: Path) -> None:
    for index, lines in enumerate(character_vectors(rdata_from_deb(deb))):
        (target / f"novel_{index}.txt").write_text("\n".join(lines) + "\n")


def rdata_from_deb(deb: bytes) -> bytes:
    """The Rdata.rdb file inside a .deb (`ar` archive -> data.tar.xz -> the file)."""
    if not deb.startswith(b"!<arch>\n"):
        raise UserError("the Austen package is not a Debian archive")
    position = 8
    while position + 60 <= len(deb):
        header = deb[position: position + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = deb[position + 60: position + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                member = tar.extractfile("./" + RDATA) or tar.extractfile(RDATA)
                return member.read()
        position += 60 + size + (size % 2)
    raise UserError("the Austen package holds no data.tar")


def character_vectors(rdb: bytes) -> list[list[str]]:
    """Every top-level character vector of an R lazy-load database (.rdb)."""
    vectors, position = [], 0
    while position < len(rdb):
        decompressor = zlib.decompressobj()
        serialised = decompressor.decompress(rdb[position + 4:])  # 4 bytes: the length
        position = len(rdb) - len(decompressor.unused_data)
        lines = _strsxp(serialised)
        if lines is not None:
            vectors.append(lines)
    return vectors


def _strsxp(data: bytes) -> list[str] | None:
    """The strings of an XDR R serialisation whose object is a STRSXP (else None)."""
    if data[:2] != b"X\n":
        return None
    version = struct.unpack(">i", data[2:6])[0]
    position = 14  # format version, writer's R version, minimal reader version
    if version == 3:  # then the native encoding's name
        position += 4 + struct.unpack(">i", data[position: position + 4])[0]
    flags, count = struct.unpack(">ii", data[position: position + 8])
    if flags & 0xFF != STRSXP:
        return None
    position += 8
    lines = []
    for _ in range(count):
        flags, length = struct.unpack(">ii", data[position: position + 8])
        position += 8
        if flags & 0xFF != CHARSXP:
            return None
        if length < 0:  # NA_character_
            lines.append("")
            continue
        lines.append(data[position: position + length].decode("utf-8", errors="replace"))
        position += length
    return lines



