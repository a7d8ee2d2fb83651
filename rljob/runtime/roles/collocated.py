"""The collocated rollout in a pod: a second process of the actor replica's container, kept by the actor's process.

A collocated job (`roles.rollout.collocated`) has no rollout pods: the device plugin gives a GPU to one container
only, and CUDA IPC handles need the same GPUs and one IPC namespace. So the process an actor pod starts
(`rljob role actor`, which for several GPUs starts the ranks) starts `rljob role rollout` beside it, with the
identity derived from its own (`RoleIdentity.collocated_rollout`), and keeps it as the operator keeps a
rollout pod (`spec.failurePolicy`, as `rljob.launch.failure_policy` applies it):

- a rollout that fails is started again after a back-off that doubles with each failure in a row (1 s, 2 s,
  4 s ... at most 60 s, each jittered to 0.5-1x); the actor's weight rounds wait for it, as for a replaced
  rollout pod. The count is forgotten once a rollout has run for 10 minutes, or exits 0.
- past `maxReplacements` failures in a row (at the first with `failurePolicy.rollout: FailJob`) the actor is
  asked to stop (SIGTERM to this process: it finishes its step, which may wait out a request to the dead
  rollout; past GIVE_UP_GRACE_S this process exits anyway) and the container ends with EXIT_ROLLOUT_GAVE_UP,
  leaving `rollout[<i>] exited with code N: <why>` as its termination message: the operator fails the job as
  it would for a rollout pod of its own (PodFailed, BackoffLimitExceeded), never restarting the actor group,
  whose new pod would count the rollout's failures from zero again. A rollout that exits EXIT_FATAL_CONFIG
  does the same at its first exit, and the container ends with that code (the operator fails the job:
  InvalidConfig).
- when the actor's program ends, whatever its code, the rollout is stopped: SIGTERM, SIGKILL after a grace.
  It also dies with this process however that ends (`rljob.runtime.process.parent_death`).
- `spec.failurePolicy` is edited without a restart (the operator rewrites the job file the pod mounts): it is
  read again from that file at each failure, before deciding whether to give up.
- the rollout runs in a session (process group) of its own, and whatever is left of that group after it exits
  or is stopped is SIGKILLed, and waited for until it has exited (`rljob.runtime.process.group_exit`), before
  anything else starts: vLLM's EngineCore and tensor-parallel workers outlive a front end that was SIGKILLed,
  keeping the GPU memory that the next start would need (this process is PID 1 of the container, and nothing
  else would end them).

- a rollout whose `/livez` says one of its loops is stuck (hung past `roles.rollout.probes.livenessTimeoutSeconds`;
  asked every LIVENESS_LOOK_S) is SIGKILLed, and counts as a failure like any other: the container's own liveness
  probe asks the actor's `/livez`, which does not cover the rollout's loops.

The actor's `/healthz` (the pod's readiness) answers ready only while the rollout's does too
(COLLOCATED_ROLLOUT_HEALTH_ENV, `rljob.runtime.wire.health`): the pod is not Ready while the rollout loads,
restarts or crash-loops, and the job's status shows it.

Every line the rollout prints goes to this process's stdout prefixed with `rollout[<i>] | `, so `kubectl logs`
of the pod shows both processes, each line telling whose it is.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from rljob.runtime.process.group_exit import GROUP_EXIT_WAIT_S, kill_group, still_running, wait_for_group_exit
from rljob.runtime.process.parent_death import LAUNCHER_PID_ENV
from rljob.runtime.process.prefixed_output import copy_prefixed
from rljob.runtime.process.retry import Backoff
from rljob.runtime.process.termination import TERMINATION_LOG, write_termination_message
from rljob.runtime.wire.identity import (
    COLLOCATED_ROLLOUT_HEALTH_ENV,
    EXIT_FATAL_CONFIG,
    EXIT_ROLLOUT_GAVE_UP,
    RoleIdentity,
)
from rljob.runtime.wire.role_http import stuck_loop

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
STABLE_S = 600.0
"""A rollout that ran this long was healthy: its failures are no longer in a row (the operator's stable time,
`rljob.launch.failure_policy.STABLE_SECONDS`, a layer above this one)."""
STOP_GRACE_S = 10.0
"""How long the rollout gets to exit after SIGTERM before it is killed."""
GIVE_UP_GRACE_S = 60.0
"""After asking the actor to stop for a rollout that cannot run: how long it gets before this process exits."""
LIVENESS_LOOK_S = 2.0
"""How often the rollout's `/livez` is asked whether it is hung."""


TEST_ROLLOUT_COMMAND_ENV = "RLJOB_TEST_COLLOCATED_ROLLOUT_COMMAND"
"""Test hook, not a user setting: a command line (split as a shell would) the actor pod's process runs as its
collocated rollout in place of `rljob role rollout`, so tests run the real `rljob role actor` beside a rollout
that fails as they need."""


def rollout_command(env: Mapping[str, str] = os.environ) -> list[str]:
    if env.get(TEST_ROLLOUT_COMMAND_ENV):
        return shlex.split(env[TEST_ROLLOUT_COMMAND_ENV])
    return [sys.executable, "-m", "rljob.cli.main", "role", "rollout"]


def pod_exit_code(actor_code: int, rollout_gave_up: int | None) -> int:
    """What the actor pod's container ends with: the actor's code, or the rollout's give-up status
    (`CollocatedRollout.gave_up`) when the actor stopped because of it. An actor that finished its steps (0) did
    its work: a rollout lost while it exported the policy does not turn a finished job into a failed one."""
    if rollout_gave_up is None or actor_code == 0:
        return actor_code
    return rollout_gave_up


def _exit_status(code: int) -> int:
    """A shell-style status: a process killed by signal N is reported as 128 + N."""
    return 128 - code if code < 0 else code


def stop_this_process() -> None:
    """Ask this process's role program to stop, as the kubelet would (its SIGTERM handler finishes the step)."""
    os.kill(os.getpid(), signal.SIGTERM)


class CollocatedRollout:
    """The rollout replica an actor replica's process runs beside it: started, restarted, stopped."""

    def __init__(
        self,
        identity: RoleIdentity,
        base_env: Mapping[str, str],
        out: BinaryIO,
        *,
        max_replacements: int,
        fail_job: bool = False,
        command: Sequence[str] | None = None,
        on_give_up: Callable[[], None] = stop_this_process,
        backoff: Backoff | None = None,
        stable_s: float = STABLE_S,
        grace_s: float = STOP_GRACE_S,
        give_up_grace_s: float = GIVE_UP_GRACE_S,
        termination_log: Path = TERMINATION_LOG,
        read_policy: Callable[[], tuple[int, bool]] | None = None,
        liveness_look_s: float = LIVENESS_LOOK_S,
    ) -> None:
        if identity.role != "rollout":
            raise ValueError(f"a collocated rollout has the rollout's identity (got {identity.role})")
        self.identity = identity
        self.command = list(command or rollout_command())
        self._from_test_hook = command is None and bool(os.environ.get(TEST_ROLLOUT_COMMAND_ENV))
        # Each line as it is printed, and death with this process first thing (see parent_death): fork-safe.
        self.env = {**base_env, **identity.to_env(), "PYTHONUNBUFFERED": "1", LAUNCHER_PID_ENV: str(os.getpid())}
        self.out = out
        self.max_replacements = max_replacements
        self.fail_job = fail_job
        self.on_give_up = on_give_up
        self.backoff = backoff or Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S)
        self.stable_s, self.grace_s, self.give_up_grace_s = stable_s, grace_s, give_up_grace_s
        self.termination_log = termination_log
        self.read_policy = read_policy
        """The job's current (maxReplacements, rollout is FailJob), asked at each failure: `spec.failurePolicy` is
        edited without a restart, the operator updating the job file under the running pod."""
        self.starts = 0
        self.failures_in_a_row = 0
        self.gave_up: int | None = None
        """The status the container ends with when the rollout could not be kept running (EXIT_FATAL_CONFIG for
        a configuration error, EXIT_ROLLOUT_GAVE_UP otherwise); None while it can."""
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        """Whole lines to the output."""
        self._spawning = threading.Lock()
        """A restart and `stop` one at a time, so no rollout is started after `stop` looked."""
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._supervisor: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self.liveness_look_s = liveness_look_s

    @property
    def name(self) -> str:
        return f"{self.identity.role}[{self.identity.replica}]"

    @property
    def health_url(self) -> str:
        """The rollout's `/healthz`, in this pod."""
        return f"http://127.0.0.1:{self.identity.metrics_port}/healthz"

    @property
    def live_url(self) -> str:
        """The rollout's `/livez`, in this pod."""
        return f"http://127.0.0.1:{self.identity.metrics_port}/livez"

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def say(self, message: str) -> None:
        with self._lock:
            self.out.write(f"{self.name} {message}\n".encode())
            self.out.flush()

    def start(self) -> CollocatedRollout:
        if self._from_test_hook:  # a pod whose env sets it by mistake says so
            self.say(f"runs {shlex.join(self.command)} ({TEST_ROLLOUT_COMMAND_ENV}) in place of the rollout role")
        self._spawn()
        self._supervisor = threading.Thread(target=self._supervise, name="collocated-rollout", daemon=True)
        self._supervisor.start()
        self._watcher = threading.Thread(target=self._watch_liveness, name="collocated-rollout-liveness", daemon=True)
        self._watcher.start()
        return self

    def _watch_liveness(self) -> None:
        """SIGKILL a running rollout whose `/livez` names a stuck loop; `_supervise` then sees it exit."""
        while not self._stopping.wait(self.liveness_look_s):
            process = self._process
            if process is None or process.poll() is not None:
                continue
            why = stuck_loop(self.live_url)
            if not why or self._stopping.is_set() or process is not self._process or process.poll() is not None:
                continue
            self.say(f"is hung ({why}): killing it")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def _spawn(self) -> None:
        process = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its group is its own, so what it leaves behind can be ended (module docstring)
        )
        self._process = process
        self._started_at = time.monotonic()
        self.starts += 1
        # Said before its first line is copied, so the log reads in the order things happened.
        if self.starts > 1:
            self.say(f"started again (pid {process.pid}, start {self.starts})")
        else:
            self.say(f"started beside the actor (pid {process.pid})")
        self._reader = threading.Thread(
            target=self._pump, args=(process,), name="collocated-rollout-output", daemon=True
        )
        self._reader.start()

    def _pump(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        copy_prefixed(process.stdout, f"{self.name} | ", self.out, self._lock)

    def _supervise(self) -> None:
        while True:
            process = self._process
            assert process is not None and self._reader is not None
            code = process.wait()
            self._end_group(process)
            self._reader.join(timeout=5)
            if self._stopping.is_set():
                return
            status = _exit_status(code)
            if code == 0:
                # Not asked to stop, yet it ended cleanly: start it again at once; no failure to count.
                self.failures_in_a_row = 0
                self.backoff.reset()
                wait = 0.0
                self.say("exited 0 while the actor runs: starting it again")
            else:
                if time.monotonic() - self._started_at >= self.stable_s:
                    self.failures_in_a_row = 0
                    self.backoff.reset()
                self.failures_in_a_row += 1
                self._refresh_policy()
                why = self._give_up_reason(status)
                if why:
                    self._give_up(status, why)
                    return
                wait = self.backoff.next()
                self.say(
                    f"exited with code {status}: starting it again in {wait:.1f}s (failure {self.failures_in_a_row} "
                    f"in a row; spec.failurePolicy.maxReplacements {self.max_replacements}); the actor waits for it"
                )
            if self._stopping.wait(wait):
                return
            with self._spawning:
                if self._stopping.is_set():  # `stop` came while the wait ended: start nothing it would miss
                    return
                self._spawn()

    def _refresh_policy(self) -> None:
        if self.read_policy is None:
            return
        try:
            policy = self.read_policy()
        except Exception as exc:  # a file being replaced, an edit that does not load: the last read stands
            self.say(f"could not read spec.failurePolicy again ({exc}); keeping what was read before")
            return
        if policy != (self.max_replacements, self.fail_job):
            rollout = "FailJob" if policy[1] else "Replace"
            self.say(f"spec.failurePolicy is now maxReplacements {policy[0]}, rollout {rollout}")
            self.max_replacements, self.fail_job = policy

    def _give_up_reason(self, status: int) -> str:
        if status == EXIT_FATAL_CONFIG:
            return "stopped on a configuration error (see its lines above); a restart would fail the same way"
        if self.fail_job:
            return "failed and spec.failurePolicy.rollout is FailJob"
        if self.failures_in_a_row > self.max_replacements:
            return (
                f"failed {self.failures_in_a_row} times in a row; spec.failurePolicy.maxReplacements is "
                f"{self.max_replacements}"
            )
        return ""

    def _give_up(self, status: int, why: str) -> None:
        # Not the rollout's own status: the operator would read it as the actor's (1 restarts the group, 65 is
        # Diverged). A configuration error keeps its code, which means the same from either process.
        code = EXIT_FATAL_CONFIG if status == EXIT_FATAL_CONFIG else EXIT_ROLLOUT_GAVE_UP
        self.gave_up = code
        write_termination_message(f"{self.name} exited with code {status}: {why}", self.termination_log)
        self.say(f"exited with code {status}: {why}; stopping the actor, which exits with code {code}")
        self.on_give_up()
        if not self._stopping.wait(self.give_up_grace_s):
            # The actor did not get out of its step: end the container anyway, with the same code.
            self.say(f"the actor did not stop within {self.give_up_grace_s:g}s: exiting with code {code}")
            sys.stdout.flush()
            os._exit(code)

    def _end_group(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL whatever is left of the exited rollout's process group (its session: the group id is its pid).

        While any process of the group is left, no other process can take its id; an empty group answers
        ProcessLookupError, and nothing is signalled."""
        if not kill_group(process.pid):
            return
        self.say(f"sent SIGKILL to what is left of its process group ({process.pid})")
        living = wait_for_group_exit(process.pid)
        if living:
            self.say(still_running(living, GROUP_EXIT_WAIT_S))

    def stop(self) -> None:
        """End the rollout (SIGTERM, SIGKILL after the grace) and its supervision; call when the actor ends."""
        with self._spawning:
            self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                self.say(f"did not stop within {self.grace_s:g}s of SIGTERM: killing it")
                process.kill()
                process.wait()
            # Only a rollout this call saw running: the supervisor ended the group of every earlier one when it
            # exited, and that group's id may since belong to another process.
            self._end_group(process)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        if self._watcher is not None:
            self._watcher.join(timeout=5)


def collocated_rollout(actor: RoleIdentity, out: BinaryIO | None = None) -> CollocatedRollout:
    """The rollout the process of `actor` (a collocated actor replica in a pod) runs, under the job's failure
    policy, not started yet. Raises InvalidRLJob when the job file does not load."""
    from rljob.api import load_job_file

    def read_policy() -> tuple[int, bool]:
        policy = load_job_file(actor.config_path).spec.failure_policy
        return policy.max_replacements, policy.rollout == "FailJob"

    max_replacements, fail_job = read_policy()
    # The actor's own identity variables (RANK, WORLD_SIZE, the collocated port ...) are not the rollout's.
    own = {*actor.to_env(), COLLOCATED_ROLLOUT_HEALTH_ENV}
    return CollocatedRollout(
        actor.collocated_rollout(),
        {k: v for k, v in os.environ.items() if k not in own},
        out or sys.stdout.buffer,
        max_replacements=max_replacements,
        fail_job=fail_job,
        read_policy=read_policy,
    )
