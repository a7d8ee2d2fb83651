"""Actor checkpoints: atomic, checksummed, pruned, and skipped with a warning when damaged.

Layout under `spec.checkpoint.dir`:

    step-00000100/state.pt        torch.save of the actor's state dict
    step-00000100/manifest.json   {"format", "step", "savedAt", "files": {name: {"sha256", "bytes"}}}
    step-00000100/sharded/...     with trainer.parallelism fsdp2: model and optimizer as torch.distributed.checkpoint
                                  shards (every actor rank writes its own), listed in the manifest too
    abandoned-at-step-.../        checkpoints of a history this run left (see below), kept for the user

A save writes a hidden temporary directory `.tmp-step-...`, flushed to disk, whose manifest is renamed
into place last: a temporary directory with a manifest is a complete save. Then the save is completed:
checkpoints of the same or a later step are moved into an `abandoned-at-step-...` directory (they belong
to the history before a resume from an older checkpoint, and `resume: auto` must not jump back to it),
the temporary directory is renamed to `step-...`, and checkpoints beyond the newest `keep` are deleted.
A crash at any point leaves either the previous checkpoints or a complete save: readers count a complete
temporary directory as its step (`checkpoints`), and the next save finishes what the crash interrupted
before it deletes any leftover. Nothing newer than a resumed checkpoint is ever deleted; abandoned
directories are never pruned (delete them when they are not wanted). One process (actor rank 0) manages
the directory; with a sharded actor the other ranks write their shards into its temporary directory
(`begin`), and rank 0 commits it after they are done (`commit`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rljob.api.upstream import EXPORT_DIR_NAME

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_SAVE_IN_PROGRESS = re.compile(r"^\.tmp-step-(\d+)-\d+$")
ABANDONED_PREFIX = "abandoned-at-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def verify(path: Path) -> int:
    """Check a checkpoint directory against its manifest; return its step or raise CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        step = int(manifest["step"])
        files: dict[str, dict[str, Any]] = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST_FILE} (an incomplete copy?)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable: {e}") from None
    if STATE_FILE not in files:
        raise CheckpointError(f"{manifest_path} lists no {STATE_FILE}")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{file} is truncated or resized: {size} bytes, manifest says {entry.get('bytes')}")
        if _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"{file} is corrupted: its sha256 does not match the manifest")
    return step


_LEAF_TYPES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def check_loadable(value: Any, where: str = "state") -> None:
    """Reject what `torch.load(weights_only=True)` would refuse, at save time and naming the key.

    Checkpoints are loaded without unpickling arbitrary objects; a numpy array or a custom class in
    the state would otherwise only fail at resume, when the checkpoint looks "corrupted".
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"checkpoint {where} has a key of type {type(key).__name__}; use str or int keys")
            check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]")
    elif not isinstance(value, _LEAF_TYPES):
        raise TypeError(
            f"checkpoint {where} is a {type(value).__module__}.{type(value).__name__}; store tensors, numbers, "
            "strings, lists or dicts (e.g. torch.from_numpy(array) or array.tolist())"
        )


def final_export_dir(run_dir: str, checkpoint_dir: Path) -> Path:
    """Where a finished job exports its model: `<run dir>/model` for `rljob run`; in a pod, which has no run
    directory, `<checkpoint.dir>/model` on the checkpoint volume, so the model outlives the pod and the next job of
    a pipeline mounts it (`source: job`)."""
    return Path(run_dir) / EXPORT_DIR_NAME if run_dir else Path(checkpoint_dir) / EXPORT_DIR_NAME


class CheckpointManager:
    """Saves and finds checkpoints in one directory, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def steps(self) -> list[tuple[int, Path]]:
        """Checkpoint directories by ascending step (by name only; not verified)."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def interrupted_saves(self) -> list[tuple[int, Path]]:
        """Complete saves (manifest written) that a crash stopped before their rename, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _SAVE_IN_PROGRESS.match(child.name)
            manifest = child / MANIFEST_FILE
            if match and manifest.is_file():
                found.append((manifest.stat().st_mtime_ns, int(match.group(1)), child))
        return [(step, path) for _, step, path in sorted(found)]

    def checkpoints(self) -> list[tuple[int, Path]]:
        """What a resume can use, by ascending step: the step directories as the next save will leave them.

        A complete save that was interrupted counts as done, exactly as the next save completes it (see
        `_complete`): it is its step, and it hides the checkpoints of that step or later. Read-only, so
        every actor rank resolves the same checkpoint whatever rank 0 has or has not finished yet.
        """
        view = dict(self.steps())
        for step, path in self.interrupted_saves():
            view = {s: p for s, p in view.items() if s < step}
            view[step] = path
        return sorted(view.items())

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` atomically; prune old ones; return its directory."""
        check_loadable(state)
        return self.commit(step, self.begin(step), state)

    def begin(self, step: int) -> Path:
        """The temporary directory of a save of `step`; other processes may write files into it before `commit`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._finish_interrupted_saves()
        tmp = self.directory / f"{_TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: Path, state: dict[str, Any]) -> Path:
        """Add `state` and the manifest of every file in `tmp`, rename it into place, prune; its directory.

        The files others wrote into `tmp` (sharded model and optimizer states) must be complete and flushed
        before this is called: they are hashed into the manifest, whose rename makes the save complete.
        """
        check_loadable(state)
        state_path = tmp / STATE_FILE
        # Straight to the file (no in-memory copy of a large model), then hashed from disk.
        with state_path.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for sub in sorted({p.parent for p in files if p.parent != tmp}):
            _fsync_dir(sub)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "savedAt": datetime.now(UTC).isoformat(),
            "files": {p.relative_to(tmp).as_posix(): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files},
        }
        # The manifest appears whole or not at all: its presence is what makes the save complete.
        partial = tmp / f"{MANIFEST_FILE}.partial"
        _write_durably(partial, json.dumps(manifest, indent=2).encode())
        os.replace(partial, tmp / MANIFEST_FILE)
        _fsync_dir(tmp)
        final = self._complete(step, tmp)
        self._prune()
        return final

    def _finish_interrupted_saves(self) -> None:
        for step, path in self.interrupted_saves():
            log.warning("completing the save of step %d that was interrupted before its rename (%s)", step, path)
            self._complete(step, path)
        for child in self.directory.iterdir():
            if child.name.startswith(_TMP_PREFIX):  # saves cut off before their manifest, or deletions
                log.info("removing %s left by an interrupted checkpoint save", child)
                shutil.rmtree(child, ignore_errors=True)

    def _complete(self, step: int, tmp: Path) -> Path:
        """Rename the complete save `tmp` into place as `step`, first moving aside any of that step or later.

        Those were saved before this run resumed from an older checkpoint: they are kept, under
        `abandoned-at-step-...`, but out of `resume: auto`'s way, which must continue this history.
        """
        later = [(s, p) for s, p in self.steps() if s >= step]
        if later:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            abandoned = self.directory / f"{ABANDONED_PREFIX}{step_dir_name(step)}-{stamp}"
            abandoned.mkdir()
            for _, path in reversed(later):
                os.replace(path, abandoned / path.name)
            log.warning(
                "moved checkpoints %s to %s: step %d was saved again after a resume from an older checkpoint",
                ", ".join(p.name for _, p in later),
                abandoned,
                step,
            )
        final = self.directory / step_dir_name(step)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        return final

    def _prune(self) -> None:
        steps = self.steps()
        for _, path in steps[: max(0, len(steps) - self.keep)]:
            # Out of sight in one rename first: a crash mid-delete leaves a temporary, not a damaged step.
            doomed = self.directory / f"{_TMP_PREFIX}deleting-{path.name}-{os.getpid()}"
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, path: str | Path) -> tuple[int, dict[str, Any]]:
        """Verify and load one checkpoint directory (or its state.pt); raise CheckpointError if unusable."""
        directory = Path(path)
        if directory.name == STATE_FILE:
            directory = directory.parent
        step = verify(directory)
        try:
            state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # a checksummed file that still fails to unpickle: written by another version
            raise CheckpointError(f"{directory / STATE_FILE} cannot be loaded: {e}") from None
        return step, state

    def latest_valid(self) -> tuple[int, dict[str, Any], Path] | None:
        """The newest checkpoint that verifies and loads; damaged ones are skipped with a warning."""
        for _, path in reversed(self.checkpoints()):
            try:
                step, state = self.load(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return step, state, path
        return None


def resolve_resume(resume: str, manager: CheckpointManager) -> tuple[int, dict[str, Any], Path] | None:
    """Apply `spec.checkpoint.resume`: `auto` (latest valid, or None), `never` (None), or a checkpoint path."""
    if resume == "never":
        return None
    if resume == "auto":
        return manager.latest_valid()
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.resume: {resume!r} does not exist; give a checkpoint directory "
            f"(like {manager.directory / step_dir_name(100)}), or `auto`, or `never`"
        )
    try:
        step, state = manager.load(path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.resume: {resume!r} cannot be used: {e}") from None
    return step, state, path


class CheckpointNotVisible(RuntimeError):
    """A rank cannot read the checkpoint rank 0 resumes from (not yet visible on its mount, say): a restart
    may get past it, so this is not a configuration error."""


def resolve_resume_across_ranks(resume: str, manager: CheckpointManager) -> tuple[int, dict[str, Any], Path] | None:
    """`resolve_resume` for every rank of the actor group: rank 0 resolves, every rank loads that checkpoint.

    Ranks that each listed the directory could pick different checkpoints (a shared filesystem's cached
    listing, a save that became visible in between) and then diverge, or hang in their first collective.
    Rank 0's answer (the path, none, or its CheckpointError) is broadcast over the actor group, so every rank
    starts from the same step or fails the same way. Without an initialised group this is `resolve_resume`.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve_resume(resume, manager)
    if dist.get_rank() == 0:
        try:
            resumed = resolve_resume(resume, manager)
        except CheckpointError as exc:
            dist.broadcast_object_list([("error", str(exc))], src=0)
            raise
        dist.broadcast_object_list([("path", None if resumed is None else str(resumed[2]))], src=0)
        return resumed
    answer: list[Any] = [None]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    if value is None:
        return None
    try:
        step, state = manager.load(value)
    except CheckpointError as exc:
        raise CheckpointNotVisible(
            f"rank {dist.get_rank()} cannot read the checkpoint rank 0 resumes from: {exc}"
        ) from None
    return step, state, Path(value)


# --- random number generator states -------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python `random`, numpy's global generator and torch (CPU and CUDA), as loadable values.

    Only tensors, lists and scalars, so checkpoints load with `torch.load(weights_only=True)`.
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": list(random.getstate()),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
