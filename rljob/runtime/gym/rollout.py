"""The rollout role (gym tasks): batched policy inference over its env replicas, weights from the actor.

A producer thread collects batches of `trainer.batchSize / numEnvs` steps; the request thread answers the
actor. The actor at policy version V with staleness budget k (`rollout.async.maxStaleness`) asks for a
batch of version >= V - k. After handing one over, the producer starts the next batch as soon as its
weights are recent enough for the actor's NEXT step (version >= V + 1 - k): with k = 0 it waits for the
new weights (on-policy), with k >= 1 it collects while the actor trains (overlap). Older batches are
dropped, never sent.

Weights arrive on a receiver thread of their own (`StagedWeights`, as in the llm rollout): `sync_weights`
only hands the sync over, so status and collect requests are answered while the tensors travel, and the
producer swaps a complete version in between two batches.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from rljob.runtime.gym.collector import TrajectoryCollector
from rljob.runtime.gym.envs import space_from_wire
from rljob.runtime.gym.models import PolicyBuilder, UnsupportedSpaceError, build_builtin_policy
from rljob.runtime.gym.torch_policy import rollout_policy
from rljob.runtime.weights.sync import StagedWeights, WeightSubscriber
from rljob.runtime.wire.context import FatalConfigError, RoleContext
from rljob.runtime.wire.transport import Payload, RequestServer, process_tag

COLLECT_WAIT_S = 0.5
"""How long a `collect` request waits for a batch before answering `ready: false` (the actor asks again),
so that a dead rollout is noticed within seconds, however long a batch takes."""


class StaleIncarnation(RuntimeError):
    """A request addressed to an earlier incarnation of this rollout replica."""


class WeightsMissing(RuntimeError):
    """The last weight sync failed on this side: the actor sends the weights again (it checks `status`)."""


class RolloutEngine:
    """Weights, versions and the batch queue shared by the request thread and the producer thread."""

    def __init__(self, context: RoleContext, build_policy: PolicyBuilder = build_builtin_policy) -> None:
        spec = context.job.spec
        identity = context.identity
        self.context = context
        self.tag = process_tag()
        self.steps_per_batch = spec.trainer.batch_size // spec.task.gym.num_envs  # type: ignore[union-attr]
        env_endpoints = identity.endpoints["env"]
        mine = [(j, e) for j, e in enumerate(env_endpoints) if j % identity.replicas == identity.replica]
        self.collector = TrajectoryCollector(mine, seed=spec.trainer.seed * 7919 + identity.replica)
        observation_space = space_from_wire(self.collector.spaces["observation_space"])
        action_space = space_from_wire(self.collector.spaces["action_space"])
        try:
            self.policy = build_policy(spec, observation_space, action_space)
        except UnsupportedSpaceError as exc:
            raise FatalConfigError(str(exc)) from None
        self.policy.eval()
        self.fast_policy = rollout_policy(self.policy, seed=spec.trainer.seed * 1000 + 17 + identity.replica)
        self.lock = threading.Condition()
        self.weights = StagedWeights(
            WeightSubscriber(identity.master_addr, identity.sync_port, spec.rollout.weight_sync.bucket_size_mb),
            self.policy,
            self._received,
        )
        self.version = -1  # of `policy`; -1: no weights yet
        self.staged_version = -1  # the newest version received completely from the current actor
        self.sync_error = ""
        self.sync_key = ""  # of the newest sync handed to the receiver: only its report counts
        self.actor_tag = ""
        self.next_required = 0
        self.ready: deque[dict[str, Any]] = deque()
        self.dropped_stale = 0
        self.batches = 0

    # --- request thread -----------------------------------------------------------------------

    def status(self, _: Payload) -> Payload:
        with self.lock:
            return {"tag": self.tag, "version": max(self.version, self.staged_version), "actor_tag": self.actor_tag}

    def sync_weights(self, request: Payload) -> Payload:
        """Hand the sync to the receiver thread and answer at once; the actor's broadcast is what waits."""
        if request["rollout_tag"] != self.tag:
            # Meant for the process this one replaced (a resent request): never join that group.
            raise StaleIncarnation(f"sync for rollout {request['rollout_tag']}, this is {self.tag}")
        with self.lock:
            if request["actor_tag"] != self.actor_tag:
                # A new actor incarnation (resumed from a checkpoint) numbers versions afresh.
                self.actor_tag = request["actor_tag"]
                self.ready.clear()
                self.version = self.staged_version = -1
                self.next_required = 0
            self.sync_error = ""
            self.sync_key = request["key"]
        self.weights.submit(request["key"], int(request["version"]), request["actor_tag"])
        return {"version": int(request["version"]), "tag": self.tag}

    def _received(self, key: str, version: int, actor_tag: str, error: BaseException | None) -> None:
        """The receiver thread's report on one sync."""
        with self.lock:
            if actor_tag != self.actor_tag:
                return  # from an actor incarnation this rollout has left behind
            if error is not None:
                if key != self.sync_key:
                    # A round the actor gave up on before it sent the newest one (this side was still making its
                    # first connection): the newest sync is under way, and its own report decides.
                    return
                self.sync_error = f"weights version {version} did not arrive: {error}"
                self.staged_version = self.version  # the staging copy holds nothing newer than the acting policy
            else:
                self.staged_version = version
                self.sync_error = ""
            self.lock.notify_all()

    def collect(self, request: Payload) -> Payload:
        actor_version, staleness = int(request["actor_version"]), int(request["max_staleness"])
        with self.lock:
            if request["actor_tag"] != self.actor_tag:
                return {"ready": False, "reason": "weights from this actor not received yet", "tag": self.tag}
            if self.sync_error:
                raise WeightsMissing(self.sync_error)
            self.next_required = max(self.next_required, actor_version - staleness)
            self.lock.notify_all()
            self.lock.wait_for(lambda: bool(self.ready), timeout=COLLECT_WAIT_S)
            while self.ready:
                batch = self.ready.popleft()
                if batch["version"] >= actor_version - staleness:
                    # The actor's next step is V + 1: the producer may start on weights >= V + 1 - k.
                    self.next_required = actor_version + 1 - staleness
                    self.lock.notify_all()
                    return {"ready": True, "tag": self.tag, "dropped_stale": self.dropped_stale, **batch}
                self.dropped_stale += 1
            return {"ready": False, "reason": "batch in progress", "tag": self.tag}

    # --- producer thread ----------------------------------------------------------------------

    def produce(self) -> None:
        while not self.context.stop.is_set():
            self.context.heartbeat.beat("produce")
            with self.lock:
                startable = self.lock.wait_for(
                    lambda: (
                        (not self.ready and max(self.version, self.staged_version) >= max(self.next_required, 0))
                        or self.context.stop.is_set()
                    ),
                    timeout=0.5,
                )
                if not startable or self.context.stop.is_set():
                    continue
                refresh = self.staged_version > self.version
            if refresh:
                # Outside the lock: a newer sync may be arriving into the staging copy, and copy_into waits for it.
                staged, staged_actor = self.weights.copy_into(self.policy)
                self.fast_policy.load(self.policy)
                with self.lock:
                    if staged < 0 or staged_actor != self.actor_tag:
                        continue  # a failed sync, or a new actor meanwhile: look again
                    self.version = staged
            with self.lock:
                version, actor_tag = self.version, self.actor_tag
            batch = self.collector.collect(self.steps_per_batch, self.fast_policy, version)
            with self.lock:
                if actor_tag == self.actor_tag:
                    self.ready.append(batch)
                    self.batches += 1
                    self.lock.notify_all()


def run_rollout(context: RoleContext, build_policy: PolicyBuilder = build_builtin_policy) -> int:
    if context.job.spec.task.gym is None:
        context.log.error("this runtime's rollout role serves gym tasks; task.type is %s", context.job.spec.task.type)
        return 1
    torch.set_num_threads(1)
    torch.distributions.Distribution.set_default_validate_args(False)
    torch.manual_seed(context.job.spec.trainer.seed * 1000 + 17 + context.identity.replica)
    from rljob.runtime.wire.health import RoleHealth

    identity = context.identity
    health = RoleHealth(context, counters={})
    engine = RolloutEngine(context, build_policy)
    health.counters.update(
        {
            "rollout_batches_total": lambda: engine.batches,
            "rollout_dropped_stale_total": lambda: engine.dropped_stale,
            "rollout_env_restarts_total": lambda: engine.collector.env_restarts,
            "rollout_policy_version": lambda: engine.version,
        }
    )
    failure: list[BaseException] = []

    def producer() -> None:
        try:
            engine.produce()
        except BaseException as exc:
            failure.append(exc)
            context.stop.set()

    thread = threading.Thread(target=producer, name="rollout-producer", daemon=True)
    server = RequestServer(
        identity.endpoints["rollout"][identity.replica],
        {"status": engine.status, "sync_weights": engine.sync_weights, "collect": engine.collect},
    )
    thread.start()
    health.ready()
    context.log.info("driving %d environments, %d steps per batch", engine.collector.num_envs, engine.steps_per_batch)
    try:
        server.serve(context.stop.is_set, beat=context.heartbeat.beat)
    finally:
        server.close()
        thread.join(timeout=5)
        engine.weights.close()
        engine.collector.close()
        health.close()
    if failure:
        context.log.error("rollout failed: %s", failure[0])
        return 1
    return 0
