"""Read a W&B offline run file (`run-*.wandb`) with wandb's own record schema.

The file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version), then
leveldb-log blocks of 32 KiB holding chunks (CRC32C, length, type FULL/FIRST/MIDDLE/LAST) of
serialized `wandb_internal_pb2.Record` messages. wandb 0.31 moved its Python reader into the
Go core, so the tests parse the framing here and decode every record with wandb's protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
CHUNK_HEADER = 7  # crc32c (4) + length (2) + type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes):
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version in (0, 1), "not a wandb run file"
    position, pending = 7, b""
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:  # block trailer padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + CHUNK_HEADER])
        payload = data[position + CHUNK_HEADER:position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""
        else:
            break  # zero padding at the end


def read_offline_run(run_dir: Path) -> dict:
    """{'config': {...}, 'history': [{key: value}], 'summary': {...}} of one offline run."""
    from wandb.proto import wandb_internal_pb2

    files = list(Path(run_dir).glob("run-*.wandb"))
    assert len(files) == 1, files
    config, history, summary = {}, [], {}
    for raw in _records(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "config" or (kind == "run" and record.run.HasField("config")):
            items = record.config.update if kind == "config" else record.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
    return {"config": config, "history": history, "summary": summary}
