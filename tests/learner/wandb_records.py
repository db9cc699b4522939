"""Read back an offline W&B run: the records of its ``run-*.wandb`` file.

wandb 0.31 writes the file from its Go core and ships no Python reader for it (the old
``wandb.sdk.internal.datastore`` is gone). The framing is LevelDB's log format (a
7-byte ``:W&B`` header, then 32 KiB blocks of records: crc32 of type and data,
little-endian length, type FULL/FIRST/MIDDLE/LAST); the payloads are decoded with
wandb's own protobuf, ``wandb.proto.wandb_internal_pb2.Record``. Checksums are verified,
so a misread frame fails the test rather than yielding garbage.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # ident, magic, version
FRAME = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    """Every record's bytes, in order, checksums verified."""
    data = path.read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out: list[bytes] = []
    pos, pending = HEADER.size, b""
    while pos + FRAME.size <= len(data):
        if BLOCK - pos % BLOCK < FRAME.size:  # too little room for a frame: block padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = FRAME.unpack_from(data, pos)
        body = data[pos + FRAME.size : pos + FRAME.size + length]
        pos += FRAME.size + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at {pos}"
        pending += body
        if kind in (FULL, LAST):
            out.append(pending)
            pending = b""
    return out


def records(run_dir: Path) -> list[Any]:
    """The run's records as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    parsed = []
    for payload in payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        parsed.append(record)
    return parsed


def history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Each history row by its step: top-level keys with their JSON values decoded."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        row = rows.setdefault(record.history.step.num, {})
        for item in record.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            row[key] = json.loads(item.value_json)
    return rows


def config(run_dir: Path) -> dict[str, Any]:
    """The run's config: every key set at init or updated later, JSON values decoded."""
    out: dict[str, Any] = {}
    for record in records(run_dir):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else ()
        updates = record.config.update if kind == "config" else updates
        for item in updates:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            out[key] = json.loads(item.value_json)
    return out
