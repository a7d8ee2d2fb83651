"""What every launcher of role processes shares: the replicas it supervises and `spec.failurePolicy` applied.

The local launcher (processes on this machine, rljob/launch/local.py) and the Ray launcher (processes started
by Ray actors on a cluster, rljob/launch/ray_cluster.py) differ only in how a replica is started, polled and
stopped; what happens when one exits is decided here, once, through `FailurePolicy`, the object the operator
uses for pods:

- a dead env, rollout or reward replica is started again in place after a back-off that doubles with each
  failure in a row (the loop keeps supervising the others meanwhile); the job fails when a replica fails more
  than `maxReplacements` times in a row (forgotten once a replacement has run for 10 minutes, or exits 0);
- a dead actor takes the whole actor group down and up again from the latest checkpoint, at most
  `maxRestarts` times;
- a role that exits with EXIT_FATAL_CONFIG (a configuration error no restart can fix) fails the job at once
  with its message;
- an actor that exits with EXIT_DIVERGED (a non-finite loss or gradient norm) fails the job at once with
  that exit code and its line (the step, the values, the last good checkpoint): a restart would diverge again;
- a replica whose `/livez` names a stuck loop (a hung process: `spec.roles.<role>.probes.livenessTimeoutSeconds`)
  is killed, every LIVENESS_LOOK_S, and its exit handled as any other, as the kubelet's liveness probe has it
  in a pod. A replica still starting or not answering is left alone (no startup budget outside a pod);
- an actor that exits with EXIT_PREEMPTED (it got SIGTERM, every rank stopped at one step boundary and rank 0
  wrote that step's checkpoint) is not a failure: once actor replica 0 has, the actor group starts again from
  that checkpoint without charging `maxRestarts`, and goes on at the next step;
- Ctrl-C (or SIGTERM to the launcher) stops the actors first, giving them `spec.checkpoint.preemptionGraceSeconds`
  to checkpoint, then the other roles; the result names the checkpoint a rerun resumes from;
- the job succeeds when actor replica 0 exits 0.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rljob.api import RLJob
from rljob.launch.failure_policy import FailurePolicy, ReplicaRecord
from rljob.runtime.records.checkpoint import CheckpointManager
from rljob.runtime.wire.identity import EXIT_DIVERGED, EXIT_FATAL_CONFIG, EXIT_PREEMPTED, RoleIdentity
from rljob.runtime.wire.role_http import stuck_loop

LOG_TAIL = 30
STOP_ORDER = {"actor": 0, "rollout": 1, "reward": 2, "env": 3}
"""Actors stop first: they drive the loop; then the servers they talk to."""
START_ORDER = ("env", "rollout", "reward", "actor")
"""Servers first, then the actors that connect to them; not required (every client waits for its peers) but
the first log lines read better."""
LIVENESS_LOOK_S = 2.0
"""How often the launcher asks each replica's `/livez` whether a loop of it is stuck."""


class LaunchError(RuntimeError):
    """The job cannot run as configured; the message names the field."""


class GiveUp(Exception):
    """Raised by `supervise`'s `on_tick` to end the run as failed (a Stalled job with `onStalled: FailJob`)."""


@dataclass
class Child:
    """One role replica as its launcher supervises it (a local process, a Ray actor's process)."""

    identity: RoleIdentity
    log_path: Path
    restarts: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    started_at: float = 0.0
    """`time.monotonic()` when this incarnation started: it has run healthy since then."""
    failures: ReplicaRecord = field(default_factory=ReplicaRecord)
    """Failures in a row of this (non-actor) replica, as the failure policy counts them."""
    replace_at: float | None = None
    """While the replica waits out its back-off: when its replacement is due (`time.monotonic()`)."""
    parked: bool = False
    """Not running by design: a rollout replica the autoscaler has not started, or has stopped."""

    @property
    def name(self) -> str:
        return f"{self.identity.role}-{self.identity.replica}"


@dataclass
class RunResult:
    exit_code: int
    reason: str
    actor_restarts: int = 0
    replica_restarts: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    """Actor group restarts after a preemption (EXIT_PREEMPTED): not charged to maxRestarts."""


LogSink = Callable[[str, str], None]
"""(child name, line) for every line a child prints."""


class Supervisor:
    """Applies the failure policy to the children of one job; subclasses start, poll and stop them."""

    job: RLJob
    policy: FailurePolicy
    run_dir: Path
    config_path: Path
    log_sink: LogSink
    children: list[Child]
    actor_restarts: int = 0
    _next_liveness_look: float = 0.0
    preemptions: int = 0

    # --- what a launcher provides -----------------------------------------------------------------

    def _start_child(self, child: Child) -> None:
        """Start (or start again) the replica's process."""
        raise NotImplementedError

    def _exit_code(self, child: Child) -> int | None:
        """The exit status of the replica's current incarnation, None while it runs."""
        raise NotImplementedError

    def _incarnation(self, child: Child) -> str:
        """An id of the current incarnation (a pid): the failure policy counts each failure once."""
        raise NotImplementedError

    def _stop_children(self, children: list[Child], grace_s: float | None = None) -> None:
        """Stop these replicas (SIGTERM, then SIGKILL after `grace_s`, the launcher's own by default) and wait."""
        raise NotImplementedError

    def _drain(self, child: Child) -> None:
        """Wait until the exited replica's last lines are in `child.tail`."""

    def _live_url(self, child: Child) -> str | None:
        """The running replica's `/livez`; None when it has none to ask (the liveness check skips it)."""
        return None

    def _kill(self, child: Child) -> None:
        """SIGKILL the replica's process (a hung one: its exit is then handled as any other)."""
        raise NotImplementedError

    def _refresh(self) -> None:
        """Called once per supervision round, before any `_exit_code` (a launcher may batch its polls)."""

    def _tick(self) -> None:
        """Called once per supervision round, after the caller's `on_tick` (the local rollout autoscaler)."""

    # --- shared -----------------------------------------------------------------------------------

    def child(self, role: str, replica: int) -> Child:
        return next(c for c in self.children if c.identity.role == role and c.identity.replica == replica)

    def write_config(self) -> None:
        resolved = self.job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
        try:
            self.config_path.write_text(yaml.safe_dump(resolved, sort_keys=False, width=100), encoding="utf-8")
        except OSError as exc:
            raise LaunchError(
                f"--out {self.run_dir}: cannot write {self.config_path} ({exc.strerror or exc})"
            ) from None

    def config_text(self) -> str:
        return self.config_path.read_text(encoding="utf-8")

    def _launch(self, child: Child) -> None:
        self._start_child(child)
        child.started_at = time.monotonic()

    def start(self) -> None:
        self.write_config()
        for role in START_ORDER:
            for child in self.children:
                if child.identity.role == role and not child.parked:
                    self._launch(child)

    def stop(self) -> None:
        # The actors first, with the time a checkpoint takes: they stop at a step boundary and write it.
        self._stop_children(self._actors(), grace_s=self.preemption_grace_s)
        self._stop_children(sorted(self.children, key=lambda c: STOP_ORDER[c.identity.role]))

    @property
    def preemption_grace_s(self) -> float:
        return float(self.job.spec.checkpoint.preemption_grace_seconds)

    def _actors(self) -> list[Child]:
        return [c for c in self.children if c.identity.role == "actor"]

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.job.spec.checkpoint.dir or self.run_dir / "checkpoints")

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest checkpoint a rerun (or a restarted actor group) resumes from, by its directory name, as this
        machine sees `checkpoint_dir` (on Ray the actor may write it on another node)."""
        found = CheckpointManager(self.checkpoint_dir).checkpoints()
        return found[-1] if found else None

    def _interrupted(self) -> RunResult:
        """Ctrl-C: the actors stop at a step boundary and checkpoint it; say where a rerun resumes."""
        self._stop_children(self._actors(), grace_s=self.preemption_grace_s)
        latest = self.latest_checkpoint()
        if latest is None:
            return self._result(
                130, f"interrupted (Ctrl-C); no checkpoint in {self.checkpoint_dir} here: a rerun starts at step 1"
            )
        step, path = latest
        return self._result(
            130,
            f"interrupted (Ctrl-C): the latest checkpoint is step {step} ({path}); run the same command again "
            f"(same --out, spec.checkpoint.resume: auto) to resume at step {step + 1}",
        )

    def supervise(self, on_tick: Callable[[], None] | None = None, poll_s: float = 0.2) -> RunResult:
        """Run until actor 0 succeeds or the failure policy gives up; always leaves no child running."""
        try:
            while True:
                if on_tick is not None:
                    on_tick()
                self._tick()
                self._refresh()
                self._kill_hung()
                for child in self.children:
                    if child.parked:
                        continue
                    if child.replace_at is not None:
                        # Waiting out its back-off: no sleep here, the other children are still watched.
                        if time.monotonic() >= child.replace_at:
                            child.replace_at = None
                            child.restarts += 1
                            self._launch(child)
                        continue
                    code = self._exit_code(child)
                    if code is None:
                        self._forgive_if_stable(child)
                        continue
                    if code == EXIT_FATAL_CONFIG:
                        return self._fatal(child)
                    if code == EXIT_DIVERGED and child.identity.role == "actor":
                        return self._diverged(child)
                    if child.identity.role == "actor":
                        outcome = self._actor_exited(child, code)
                        if outcome is None:
                            continue
                        if isinstance(outcome, RunResult):
                            return outcome
                        break  # the actor group was restarted: poll every child afresh
                    failed = self._replica_exited(child, code)
                    if failed is not None:
                        return failed
                time.sleep(poll_s)
        except KeyboardInterrupt:
            return self._interrupted()
        except GiveUp as reason:
            return self._result(1, str(reason))
        finally:
            self.stop()

    def _kill_hung(self) -> None:
        """Kill each running replica whose `/livez` names a stuck loop, saying so (module docstring)."""
        if time.monotonic() < self._next_liveness_look:
            return
        self._next_liveness_look = time.monotonic() + LIVENESS_LOOK_S
        for child in self.children:
            if child.parked or child.replace_at is not None or self._exit_code(child) is not None:
                continue
            url = self._live_url(child)
            why = stuck_loop(url) if url else ""
            if why:
                self.log_sink("launcher", f"{child.name} is hung ({why}): killing it")
                self._kill(child)

    def _actor_exited(self, child: Child, code: int) -> RunResult | bool | None:
        """A RunResult to end the run, True after restarting the actor group, None to go on."""
        if code == 0 and child.identity.replica == 0:
            return self._result(0, f"reached trainer.steps ({self.job.spec.trainer.steps})")
        if code == 0:
            return None  # a non-zero rank finished its last update; rank 0 is finishing too
        if code == EXIT_PREEMPTED:
            return self._actor_preempted(child)
        policy = self.policy
        reason = f"{child.name} exited with code {code}"
        if policy.fails_job("actor"):
            return self._result(1, f"{reason} (failurePolicy.actor is FailJob)", child)
        if not policy.may_restart_group(self.actor_restarts):
            return self._result(1, f"{reason}; failurePolicy.maxRestarts ({policy.max_restarts}) exhausted", child)
        self.actor_restarts += 1
        self.log_sink(
            "launcher",
            f"{reason}: restarting the actor group from the latest checkpoint "
            f"({self.actor_restarts}/{policy.max_restarts})",
        )
        actors = [c for c in self.children if c.identity.role == "actor"]
        self._stop_children(actors)
        for actor in actors:
            actor.restarts += 1
            self._launch(actor)
        return True

    def _actor_preempted(self, child: Child) -> bool | None:
        """The actor group stopped at a step boundary on SIGTERM and replica 0 checkpointed it: start it again from
        there, uncharged. A replica other than 0 waits for replica 0, which may still be writing."""
        if child.identity.replica != 0:
            return None
        self.preemptions += 1
        latest = self.latest_checkpoint()
        where = f"step {latest[0]} ({latest[1]})" if latest else f"its latest checkpoint in {self.checkpoint_dir}"
        self.log_sink(
            "launcher",
            f"{child.name} exited with code {EXIT_PREEMPTED} (preempted: stopped on SIGTERM at a step boundary): "
            f"restarting the actor group from {where}, not counted against failurePolicy.maxRestarts",
        )
        actors = self._actors()
        self._stop_children(actors, grace_s=self.preemption_grace_s)
        for actor in actors:
            actor.restarts += 1
            self._launch(actor)
        return True

    def _replica_exited(self, child: Child, code: int) -> RunResult | None:
        """Schedule the replacement of a dead env/rollout/reward replica, or end the run (FailJob, bound)."""
        policy = self.policy
        role = child.identity.role
        reason = f"{child.name} exited with code {code}"
        if code == 0:
            # Not a failure: the failures are no longer in a row; started again at once.
            policy.forgive(child.failures)
            self.log_sink("launcher", f"{reason}: replacing it")
            child.replace_at = time.monotonic()
            return None
        if policy.fails_job(role):
            return self._result(1, f"{reason} (failurePolicy.{role} is FailJob)", child)
        verdict = policy.replica_failed(child.failures, self._incarnation(child), time.monotonic())
        if verdict.give_up:
            return self._result(
                1,
                f"{reason}; it failed {verdict.count} times in a row: "
                f"spec.failurePolicy.maxReplacements ({policy.max_replacements}) exhausted",
                child,
            )
        self.log_sink(
            "launcher",
            f"{reason}: replacing it in {verdict.backoff_seconds:g}s "
            f"(failure {verdict.count} in a row; spec.failurePolicy.maxReplacements {policy.max_replacements})",
        )
        child.replace_at = time.monotonic() + policy.replace_in(child.failures, time.monotonic())
        return None

    def _forgive_if_stable(self, child: Child) -> None:
        now = time.monotonic()
        left = self.policy.healthy_left(child.failures, self._incarnation(child), child.started_at, now)
        if left is not None and left <= 0:
            self.policy.forgive(child.failures)

    def _last_error(self, child: Child) -> str:
        """The last ERROR line the child logged, without its prefix ("" when there is none)."""
        self._drain(child)  # its last lines (the error) are in the tail once its output is drained
        errors = [line for line in child.tail if " ERROR " in line]
        message = errors[-1].split(" ERROR ", 1)[1] if errors else ""
        if message.startswith(f"{child.identity.role}[{child.identity.replica}] "):
            message = message.split(" ", 1)[1]
        return message

    def _fatal(self, child: Child) -> RunResult:
        """A role stopped on a configuration error: restarting it would fail the same way."""
        message = self._last_error(child)
        reason = f"{child.name} stopped on a configuration error that no restart can fix"
        if not message:
            return self._result(1, reason, child)
        return self._result(1, f"{reason}: {message}\n(full log: {child.log_path})")

    def _diverged(self, child: Child) -> RunResult:
        """The actor stopped on a non-finite update: restarting from the same checkpoint would diverge again."""
        message = self._last_error(child) or f"exited with code {EXIT_DIVERGED}"
        reason = f"{child.name} {message}; not restarted (it would diverge again from the same checkpoint)"
        return self._result(EXIT_DIVERGED, f"{reason}\n(full log: {child.log_path})")

    def _result(self, code: int, reason: str, failed: Child | None = None) -> RunResult:
        if failed is not None and failed.tail:
            reason += f"\nlast lines of {failed.name} (full log: {failed.log_path}):\n  " + "\n  ".join(failed.tail)
        return RunResult(
            code,
            reason,
            actor_restarts=self.actor_restarts,
            replica_restarts={c.name: c.restarts for c in self.children if c.restarts},
            preemptions=self.preemptions,
        )
