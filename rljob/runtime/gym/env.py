"""The env role: serves its share of `task.gym.numEnvs` gymnasium environments over the transport.

Methods: `spaces` (observation/action space), `reset` (seeded), `step` (actions for this replica's
environments -> observations, rewards, terminated, truncated, final observations, successes, and the rewards
before any wrapper). A restarted env process answers `step` with `EnvNotReset` until the rollout resets it.

`/metrics` has `rljob_env_steps_total` and `rljob_env_replica_steps_per_second`: environment steps this replica
served per second over the last RATE_WINDOW_S, the simulator's throughput as the rollout drives it.
"""

from __future__ import annotations

import time
from collections import deque

from rljob.runtime.gym.envs import GymConfigError, VectorGymEnv, env_share, space_to_wire
from rljob.runtime.wire.context import FatalConfigError, RoleContext
from rljob.runtime.wire.transport import Payload, RequestServer, process_tag

RATE_WINDOW_S = 30.0


class StepRate:
    """Environment steps per second over a sliding window of recent `step` calls."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.calls: deque[tuple[float, int]] = deque()

    def add(self, steps: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.calls.append((now, steps))
        while self.calls and self.calls[0][0] < now - self.window_s:
            self.calls.popleft()

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in self.calls if t >= now - self.window_s]
        if len(recent) < 2:
            return 0.0
        span = now - recent[0][0]
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0


def run_env(context: RoleContext) -> int:
    task = context.job.spec.task.gym
    if task is None:
        context.log.error("the env role serves gym tasks; this job's task.type is %s", context.job.spec.task.type)
        return 1
    identity = context.identity
    start, count = env_share(task.num_envs, identity.replicas, identity.replica)
    try:
        model = context.job.spec.model
        envs = VectorGymEnv(task, count, model.builtin, vla=model.vla is not None)
    except GymConfigError as exc:
        raise FatalConfigError(str(exc)) from None
    tag = process_tag()
    steps = 0
    rate = StepRate()

    def spaces(_: Payload) -> Payload:
        return {
            "observation_space": space_to_wire(envs.observation_space),
            "action_space": space_to_wire(envs.action_space),
            "count": count,
            "first": start,
            "tag": tag,
        }

    def reset(request: Payload) -> Payload:
        seed = request.get("seed")
        # Distinct seeds per environment across replicas, shifted by the rollout on every reset.
        obs = envs.reset(None if seed is None else int(seed) + start)
        return {"obs": obs, "tag": tag}

    def step(request: Payload) -> Payload:
        nonlocal steps
        result = envs.step(request["actions"])
        steps += count
        rate.add(count)
        return {
            "obs": result.obs,
            "rewards": result.rewards,
            "terminated": result.terminated,
            "truncated": result.truncated,
            "final_obs": result.final_obs,
            "successes": result.successes,
            "raw_rewards": result.raw_rewards,
            "tag": tag,
        }

    from rljob.runtime.wire.health import RoleHealth

    health = RoleHealth(
        context, counters={"env_steps_total": lambda: steps, "env_replica_steps_per_second": rate.per_second}
    )
    server = RequestServer(
        identity.endpoints["env"][identity.replica], {"spaces": spaces, "reset": reset, "step": step}
    )
    health.ready()
    context.log.info(
        "serving %d %s environments (%d..%d, %s)", count, task.env_id, start, start + count - 1, task.vectorization
    )
    try:
        server.serve(context.stop.is_set, beat=context.heartbeat.beat)
    finally:
        server.close()
        envs.close()
        health.close()
    return 0
