"""The env role of llm jobs with `task.llm.env`: serves the text environment to the rollout replicas.

Methods: `status` -> {"tag", "env"}; `reset {rows}` -> {"messages": [[Message, ...] per row]};
`step {episodes: [{messages, response, row}]}` -> {"results": [{messages, reward, done, info}], "errors"}.
The environment is stateless between requests (everything a step needs travels with it), so the rollout may
send any episode to any replica. An environment that raises or returns something malformed on one episode
ends that episode (done, reward 0, `info.error`) and is counted; it never stops the role. One that cannot be
loaded is a FatalConfigError (exit 78).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rljob.runtime.llm.episodes.textenv import (
    StepResult,
    TextEnv,
    TextEnvConfigError,
    TextEnvOutputError,
    check_messages,
    check_step,
    load_text_env,
    wants_row,
)
from rljob.runtime.wire.context import FatalConfigError, RoleContext
from rljob.runtime.wire.transport import Payload, RequestServer, process_tag


class TextEnvService:
    """The request handlers around one environment instance; counts steps and failures."""

    def __init__(self, env: TextEnv, label: str, log: Any = None) -> None:
        self.env = env
        self.label = label
        self.log = log
        self.tag = process_tag()
        self.with_row = wants_row(env)
        self.steps = 0
        self.errors = 0
        self._warned = False

    def status(self, _: Payload) -> Payload:
        return {"tag": self.tag, "env": self.label}

    def reset(self, request: Payload) -> Payload:
        openings = []
        for row in request["rows"]:
            try:
                openings.append(check_messages(self.env.reset(row), "reset"))
            except Exception as exc:  # the episode opens with nothing; the failure is counted
                self._failed("reset", exc)
                openings.append([])
        return {"messages": openings, "tag": self.tag, "errors": self.errors}

    def step(self, request: Payload) -> Payload:
        results = []
        for episode in request["episodes"]:
            extra = {"row": episode.get("row", {})} if self.with_row else {}
            try:
                result = check_step(self.env.step(list(episode["messages"]), episode["response"], **extra))
            except Exception as exc:
                self._failed("step", exc)
                result = StepResult([], 0.0, True, {"error": f"{type(exc).__name__}: {exc}"})
            results.append(result.to_wire())
        self.steps += len(results)
        return {"results": results, "tag": self.tag, "errors": self.errors}

    def _failed(self, method: str, exc: Exception) -> None:
        self.errors += 1
        if self.log is not None and not self._warned:  # the first failure says what is wrong; then it is counted
            self._warned = True
            kind = "returned a malformed result" if isinstance(exc, TextEnvOutputError) else "raised"
            self.log.warning("text env %s %s %s (episode ended, counted): %s", self.label, method, kind, exc)


def run_text_env(context: RoleContext) -> int:
    spec = context.job.spec
    if spec.task.llm is None or spec.task.llm.env is None:
        context.log.error("this env role serves task.llm.env; this job has none (set spec.roles.env.replicas: 0)")
        return 1
    env_spec = spec.task.llm.env
    try:
        # Relative `file.py` references resolve against the working directory the role was started in.
        env = load_text_env(env_spec, base_dir=Path.cwd())
    except TextEnvConfigError as exc:
        raise FatalConfigError(str(exc)) from None
    label = env_spec.builtin or env_spec.module or ""
    service = TextEnvService(env, label, context.log)
    from rljob.runtime.wire.health import RoleHealth

    health = RoleHealth(
        context,
        counters={"env_steps_total": lambda: service.steps, "env_errors_total": lambda: service.errors},
    )
    identity = context.identity
    server = RequestServer(
        identity.endpoints["env"][identity.replica],
        {"status": service.status, "reset": service.reset, "step": service.step},
    )
    health.ready()
    context.log.info("serving the text environment %s (maxTurns %d)", label, env_spec.max_turns)
    try:
        server.serve(context.stop.is_set, beat=context.heartbeat.beat)
    finally:
        server.close()
        health.close()
    return 0
