"""Read back what each tracker wrote, with the trackers' own formats: TensorBoard's EventAccumulator, MLflow's client
on its file store, W&B's and SwanLab's record protobufs in their offline run files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
"""W&B's run file is a LevelDB-style log: 32 KiB blocks of records, each with a 7-byte header."""


def _leveldb_records(path: Path, ident: bytes) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == ident, f"{path} does not start with {ident!r}"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
    return out


def wandb_runs(root: Path) -> list[dict[str, Any]]:
    """The offline runs under `root` (W&B's `dir`), by name: see `wandb_run`. A run whose process was killed before
    W&B wrote its first record is left out."""
    runs = [wandb_run(path) for path in root.glob("wandb/offline-run-*/run-*.wandb")]
    return sorted((run for run in runs if "name" in run), key=lambda r: r["name"])


def wandb_run(path: Path) -> dict[str, Any]:
    """One offline run file: the run's name, group, config, history rows by step, logged artifacts' references."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"history": {}, "artifacts": []}
    for raw in _leveldb_records(path, b":W&B"):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"] = record.run.display_name
            run["group"] = record.run.run_group
            run["config"] = {
                item.key: json.loads(item.value_json) for item in record.run.config.update if item.key != "_wandb"
            }
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            run["history"][row["_step"]] = row
        elif kind == "artifact":
            refs = [entry.ref for entry in record.artifact.manifest.contents]
            run["artifacts"].append({"name": record.artifact.name, "type": record.artifact.type, "refs": refs})
    return run


def swanlab_runs(root: Path) -> list[dict[str, Any]]:
    """The offline runs under `root` (SwanLab's `log_dir`), by name: see `swanlab_run`."""
    return sorted((swanlab_run(path.parent) for path in root.glob("run-*/run-*.swanlab")), key=lambda r: r["name"])


def swanlab_run(folder: Path) -> dict[str, Any]:
    """One offline run's folder: name, group, config (config.yaml), scalars by key and step, texts by key."""
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = folder.glob("run-*.swanlab")
    run: dict[str, Any] = {"scalars": {}, "texts": {}}
    reader = DataStoreReader()
    reader.open(path)
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "start":
            run["name"] = record.start.name
            run["group"] = record.start.group
        elif kind == "scalar":
            scalar = record.scalar
            run["scalars"].setdefault(scalar.key, {})[scalar.step] = scalar.value.number
        elif kind == "media":
            for item in record.media.value.items:
                text = item.payload.decode() if item.payload else _media_file(folder, item.filename)
                run["texts"].setdefault(record.media.key, []).append(text)
    reader.close()
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    run["config"] = {key: value["value"] for key, value in config.items()}
    return run


def _media_file(folder: Path, filename: str) -> str:
    (path,) = folder.glob(f"media/**/{Path(filename).name}")
    return path.read_text()
