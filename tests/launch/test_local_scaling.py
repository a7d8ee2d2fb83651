"""`rljob run`'s rollout scaler: which processes start and stop, and what the actor's membership file lists."""

from __future__ import annotations

from pathlib import Path

from rljob.api.spec import AutoscaleSpec
from rljob.launch.local_scaling import RolloutScaler, initial_count
from rljob.runtime.llm.replicas.membership import parse_members

SPEC = AutoscaleSpec(
    min_replicas=1, max_replicas=3, target_trainer_wait=0.2, scale_up_cooldown_seconds=0, scale_down_cooldown_seconds=0
)
ENDPOINTS = {0: "127.0.0.1:1000", 1: "127.0.0.1:1001", 2: "127.0.0.1:1002"}


class Processes:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.up: set[int] = {0}
        self.members_at_stop: list[list[int]] = []

    def start(self, replica: int) -> None:
        self.calls.append(f"start {replica}")

    def stop(self, replica: int) -> None:
        self.calls.append(f"stop {replica}")


def members(path: Path) -> list[int]:
    return sorted(parse_members(path.read_text()))


def scaler(tmp_path: Path, processes: Processes, replicas: int = 1) -> RolloutScaler:
    return RolloutScaler(
        SPEC,
        replicas,
        ENDPOINTS,
        tmp_path / "rollouts.json",
        start=processes.start,
        stop=lambda r: (processes.members_at_stop.append(members(tmp_path / "rollouts.json")), processes.stop(r)),
        ready=lambda r: r in processes.up,
        say=lambda line: processes.calls.append(line),
    )


def test_the_run_starts_within_the_bounds():
    assert initial_count(SPEC, 0) == 1 and initial_count(SPEC, 2) == 2 and initial_count(SPEC, 9) == 3


def test_a_started_rollout_joins_the_membership_only_once_it_answers(tmp_path: Path):
    processes = Processes()
    scale = scaler(tmp_path, processes)
    scale.write_members()
    assert members(tmp_path / "rollouts.json") == [0]
    scale.observe({"step": 1, "trainerWait": 0.5, "rolloutIdle": 0.0})
    scale.observe({"step": 2, "trainerWait": 0.5, "rolloutIdle": 0.0})
    assert processes.calls[-1] == "start 1" and scale.count == 2
    assert members(tmp_path / "rollouts.json") == [0]  # started, not up yet
    processes.up.add(1)
    scale.observe(None)
    assert members(tmp_path / "rollouts.json") == [0, 1] and scale.history == [1, 2]


def test_a_rollout_leaves_the_membership_before_its_process_stops(tmp_path: Path):
    processes = Processes()
    processes.up = {0, 1, 2}
    scale = scaler(tmp_path, processes, replicas=3)
    scale.write_members()
    for step in (1, 2):
        scale.observe({"step": step, "trainerWait": 0.01, "rolloutIdle": 0.9})
    assert processes.calls[-1] == "stop 2" and scale.count == 2
    assert processes.members_at_stop == [[0, 1]]
    assert processes.calls[0].startswith("autoscale: the trainer waited 1% of its last 2 steps")
