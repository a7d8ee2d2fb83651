import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from rljob.runtime.records.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    resolve_resume,
    restore_rng_state,
    verify,
)


def state_of(step: int) -> dict:
    return {"step": step, "weights": torch.full((4,), float(step)), "data_position": step * 256}


def test_save_then_latest_valid_round_trips(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    path = manager.save(10, state_of(10))
    assert path.name == "step-00000010"
    step, state, found = manager.latest_valid()
    assert (step, found) == (10, path)
    torch.testing.assert_close(state["weights"], torch.full((4,), 10.0))
    assert state["data_position"] == 2560


def test_only_the_last_keep_checkpoints_are_kept(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, state_of(step))
    assert [step for step, _ in manager.steps()] == [3, 4]


def test_a_crash_mid_save_leaves_the_previous_checkpoint_valid(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, state_of(1))
    # A real process killed by SIGKILL while torch.save is writing the state of step 2: the last
    # tensor kills its own process when pickled, after the first tensor's bytes are in the file.
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from rljob.runtime.records.checkpoint import CheckpointManager

        class DiesWhilePickled(torch.Tensor):
            def __reduce_ex__(self, protocol):
                os.kill(os.getpid(), signal.SIGKILL)

        state = {{"weights": torch.zeros(1000), "bomb": torch.zeros(3).as_subclass(DiesWhilePickled)}}
        CheckpointManager({str(tmp_path)!r}, keep=3).save(2, state)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()
    assert [step for step, _ in manager.steps()] == [1]
    step, _, _ = manager.latest_valid()
    assert step == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the interrupted save should have left its temporary directory"
    manager.save(3, state_of(3))  # the next save cleans up after the crash
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", "truncated"),
        ("flip", "corrupted"),
        ("manifest", "no manifest.json"),
    ],
)
def test_a_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, damage, reason):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, state_of(1))
    newest = manager.save(2, state_of(2))
    state_file = newest / "state.pt"
    if damage == "truncate":
        state_file.write_bytes(state_file.read_bytes()[:50])
    elif damage == "flip":
        data = bytearray(state_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state_file.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="rljob.runtime.records.checkpoint"):
        step, state, _ = manager.latest_valid()
    assert step == 1 and state["data_position"] == 256
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(newest) in warning and reason in warning


def test_no_valid_checkpoint_means_a_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path / "missing").latest_valid() is None
    assert resolve_resume("auto", CheckpointManager(tmp_path)) is None


def test_resolve_resume_auto_never_and_explicit_path(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    first = manager.save(1, state_of(1))
    manager.save(2, state_of(2))
    assert resolve_resume("never", manager) is None
    assert resolve_resume("auto", manager)[0] == 2
    step, state, _ = resolve_resume(str(first), manager)
    assert step == 1 and state["data_position"] == 256
    assert resolve_resume(str(first / "state.pt"), manager)[0] == 1


def test_resolve_resume_explicit_path_missing_or_corrupt_names_the_field(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume: .*does not exist"):
        resolve_resume(str(tmp_path / "step-00000099"), manager)
    path = manager.save(1, state_of(1))
    (path / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume: .*cannot be used: .*truncated"):
        resolve_resume(str(path), manager)


def test_resuming_an_older_checkpoint_moves_newer_ones_aside_and_never_deletes_them(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    first = manager.save(1, state_of(1))
    for step in (2, 3):
        manager.save(step, state_of(step))
    assert resolve_resume(str(first), manager)[0] == 1  # `resume: <path of step 1>`
    manager.save(2, {**state_of(2), "history": "resumed"})
    # `resume: auto` continues the resumed history ...
    assert [step for step, _ in manager.steps()] == [1, 2]
    step, state, _ = manager.latest_valid()
    assert (step, state["history"]) == (2, "resumed")
    # ... and the checkpoints it left are all still there, intact and usable as a resume path.
    (abandoned,) = tmp_path.glob("abandoned-at-step-00000002-*")
    assert sorted(p.name for p in abandoned.iterdir()) == ["step-00000002", "step-00000003"]
    for path in abandoned.iterdir():
        step, state, _ = resolve_resume(str(path), manager)
        assert "history" not in state and state["data_position"] == step * 256


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, {"rng": capture_rng_state()})
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(manager.latest_valid()[1]["rng"])
    got = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    assert got[:3] == expected[:3]
    torch.testing.assert_close(got[3], expected[3])


def _train_step(model, optimizer, data, targets):
    # Minibatch drawn with torch, noise with numpy and an index with python random: all three RNGs matter.
    idx = torch.randperm(len(data))[:8]
    noise = torch.from_numpy(np.random.normal(size=(8, 1)).astype(np.float32))
    offset = random.random()
    loss = ((model(data[idx] + noise) - targets[idx] - offset) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def _fresh(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Linear(1, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def test_a_resumed_run_reproduces_the_next_step_loss(tmp_path):
    data = torch.linspace(-1, 1, 32).unsqueeze(1)
    targets = 3 * data
    model, optimizer = _fresh(0)
    for _ in range(3):
        _train_step(model, optimizer, data, targets)
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(3, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng_state()})
    uninterrupted = [_train_step(model, optimizer, data, targets) for _ in range(2)]

    model, optimizer = _fresh(123)  # a restarted process: different initial state until restored
    step, state, _ = manager.latest_valid()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    restore_rng_state(state["rng"])
    resumed = [_train_step(model, optimizer, data, targets) for _ in range(2)]
    assert step == 3
    assert resumed == uninterrupted


def test_state_that_could_not_be_loaded_safely_is_rejected_at_save_time(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    with pytest.raises(TypeError, match=r"state\['data'\]\['order'\] is a numpy.ndarray"):
        manager.save(1, {"data": {"order": np.arange(3)}})
    assert manager.steps() == []


# --- a crash at every point of a save ------------------------------------------------------------

# Saves once per kill point, each time in a forked child that SIGKILLs itself just before its n-th
# filesystem step (fsync, rename, delete), until a save gets through: every point is tried.
_KILL_AT_EACH_POINT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from rljob.runtime.records.checkpoint import CheckpointManager
    from tests.crash_points import kill_at_each_point

    base, keep, setup, damage, step, copy = sys.argv[1:7]

    def prepare(n):
        directory = os.path.join(base, f"kill-{n}")
        manager = CheckpointManager(directory, keep=int(keep))
        for s in json.loads(setup):
            manager.save(s, {"step": s, "copy": "old", "weights": torch.full((4,), float(s))})
        if damage != "none":
            with open(os.path.join(directory, f"step-{int(damage):08d}", "state.pt"), "r+b") as f:
                f.truncate(50)
        return manager

    def save(manager):
        manager.save(int(step), {"step": int(step), "copy": copy, "weights": torch.full((4,), float(step))})

    print(json.dumps(kill_at_each_point(prepare, save, also_rmtree=True)))
    """
)


def killed_saves(tmp_path, keep: int, setup: list[int], save: int, damage: int | None = None) -> list:
    """The checkpoint directories left by a save of step `save` (copy "new") killed at each point in turn."""
    args = [str(tmp_path), str(keep), json.dumps(setup), str(damage or "none"), str(save), "new"]
    done = subprocess.run([sys.executable, "-c", _KILL_AT_EACH_POINT, *args], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    statuses = json.loads(done.stdout)
    assert statuses[-1] == 0 and all(os.WIFSIGNALED(s) for s in statuses[:-1])
    assert len(statuses) > 5  # the points exist: fsyncs of the files, renames, deletions
    return [tmp_path / f"kill-{n}" for n in range(1, len(statuses))]


def complete_copy_on_disk(directory, step: int) -> bool:
    """Whether every byte of the new save of `step` is on disk somewhere in `directory`, by its checksums."""
    for path in directory.iterdir():
        if path.name.startswith("abandoned-") or not (path / "manifest.json").is_file():
            continue
        try:
            verify(path)
        except CheckpointError:
            continue
        state = torch.load(path / "state.pt", weights_only=True)
        if state["step"] == step and state["copy"] == "new":
            return True
    return False


def assert_the_restarted_run_keeps_what_it_resumed(directory, resumed: int) -> None:
    """The restarted run saves the next step: the checkpoint it resumed from must survive that save."""
    manager = CheckpointManager(directory, keep=3)
    manager.save(resumed + 1, {"step": resumed + 1, "copy": "next", "weights": torch.zeros(4)})
    assert resumed in [step for step, _ in manager.steps()]
    for _, path in manager.steps():
        verify(path)
    assert manager.latest_valid()[0] == resumed + 1
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_a_save_killed_at_any_point_resumes_from_the_newest_complete_step(tmp_path):
    for directory in killed_saves(tmp_path, keep=2, setup=[1, 2], save=3):
        step, state, _ = CheckpointManager(directory, keep=2).latest_valid()
        expected = 3 if complete_copy_on_disk(directory, 3) else 2
        assert (step, state["step"]) == (expected, expected), directory.name
        assert_the_restarted_run_keeps_what_it_resumed(directory, step)


def test_saving_a_step_again_killed_between_its_renames_keeps_the_new_copy(tmp_path):
    """Step 2 was damaged, the run resumed from 1 and saves 2 again: old and new copy swap places."""
    for directory in killed_saves(tmp_path, keep=3, setup=[1, 2], save=2, damage=2):
        step, state, _ = CheckpointManager(directory, keep=3).latest_valid()
        if complete_copy_on_disk(directory, 2):
            assert (step, state["copy"]) == (2, "new"), directory.name
        else:
            assert step == 1, directory.name
        assert_the_restarted_run_keeps_what_it_resumed(directory, step)


class NewestAppearsAfterListing(CheckpointManager):
    """Rank 0's listing misses the newest checkpoint, as a shared filesystem's cached listing can: step 3
    appears in the directory right after rank 0 has listed it."""

    def checkpoints(self):
        listed = super().checkpoints()
        CheckpointManager(self.directory).save(3, state_of(3))
        return listed


def resume_on_rank(rank: int, port: int, directory: str, resume: str, out: str) -> None:
    """One actor rank of a two-rank gloo group resolving its resume checkpoint; writes what it got to `out`."""
    import datetime
    import time
    from pathlib import Path

    import torch.distributed as dist

    from rljob.runtime.records.checkpoint import resolve_resume_across_ranks, step_dir_name

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if rank == 0:
            manager = NewestAppearsAfterListing(directory)
        else:
            manager = CheckpointManager(directory)
            deadline = time.monotonic() + 60
            while (
                resume == "auto" and not (Path(directory) / step_dir_name(3)).exists() and time.monotonic() < deadline
            ):
                time.sleep(0.05)  # rank 1 looks only once rank 0 has listed (and step 3 has appeared)
        try:
            resumed = resolve_resume_across_ranks(resume, manager)
            got = None if resumed is None else {"step": resumed[0], "weights": resumed[1]["weights"][0].item()}
        except CheckpointError as exc:
            got = {"error": str(exc)}
        Path(out).write_text(json.dumps(got))
        dist.barrier()  # both answers written before either leaves the group
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, resume: str) -> list:
    import multiprocessing

    from rljob.launch.local import free_ports

    directory = tmp_path / "checkpoints"
    manager = CheckpointManager(directory)
    for step in (1, 2):
        manager.save(step, state_of(step))
    port = free_ports(1)[0]
    spawn = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [
        spawn.Process(target=resume_on_rank, args=(rank, port, str(directory), resume, str(outs[rank])))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    return [json.loads(out.read_text()) for out in outs]


def test_every_actor_rank_resumes_from_the_checkpoint_rank_0_resolved(tmp_path):
    rank0, rank1 = run_two_ranks(tmp_path, "auto")
    assert rank0 == {"step": 2, "weights": 2.0}
    assert rank1 == rank0  # not step 3, which only rank 1 saw


def test_a_resume_path_rank_0_cannot_use_fails_on_every_rank_without_a_hang(tmp_path):
    rank0, rank1 = run_two_ranks(tmp_path, str(tmp_path / "no-such-checkpoint"))
    assert "checkpoint.resume:" in rank0["error"] and "does not exist" in rank0["error"]
    assert rank1 == rank0
