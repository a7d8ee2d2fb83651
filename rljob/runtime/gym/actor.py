"""The actor role: the PPO trainer group. Rank 0 is the single controller of the loop.

The group has one rank per GPU of every actor replica (`gpusPerReplica`, one on CPU); global rank 0 is
replica 0's local rank 0.

Per step, rank 0 publishes the current weights to every rollout replica (versioned broadcast), takes one
batch from each (within the staleness budget), shares the batch with the other ranks, and every rank runs
the same PPO update under DDP. Rank 0 then logs metrics, reports progress and checkpoints. A rollout that
restarted is noticed by its new tag and simply gets the weights again; its lost batch is asked for anew,
so no step is skipped or done twice.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rljob.runtime.gym.envs import space_from_wire
from rljob.runtime.gym.models import PolicyBuilder, UnsupportedSpaceError, build_builtin_policy
from rljob.runtime.gym.ppo import BATCH_FIELDS, GymBatch, PPOLearner
from rljob.runtime.optim.divergence import Diverged, diverged_exit
from rljob.runtime.process.log_limit import LimitedLog, reason_of
from rljob.runtime.process.retry import Backoff, retry
from rljob.runtime.records.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    resolve_resume_across_ranks,
    restore_rng_state,
)
from rljob.runtime.records.metrics import (
    APPROX_KL,
    CLIP_FRACTION,
    ENTROPY,
    ENV_STEPS,
    ENV_STEPS_PER_S,
    EPISODES,
    EXPLAINED_VARIANCE,
    LEARNING_RATE,
    LENGTH_MEAN,
    POLICY_LOSS,
    RETURN_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    SUCCESS_RATE,
    VALUE_LOSS,
    RunMetrics,
    keep_records_until,
    phase_key,
)
from rljob.runtime.weights.sync import SyncRefused, WeightPublisher
from rljob.runtime.wire.context import FatalConfigError, RoleContext, start_trackers
from rljob.runtime.wire.deadlines import LateReplicas
from rljob.runtime.wire.identity import EXIT_PREEMPTED
from rljob.runtime.wire.ranks import STOP_NOW, agree_to_stop, join_actor_group, nccl_config_error, rank_device
from rljob.runtime.wire.role_http import ProgressTracker
from rljob.runtime.wire.transport import RequestClient, RequestTimeout, TransportError, process_tag

GROUP_TIMEOUT_MINUTES = 5
ROLLOUT_WAIT_S = 300.0
"""How long rank 0 waits for a silent rollout replica (being replaced, say) before it fails."""
ENV_WAIT_S = 600.0
"""How long the actor waits for env replica 0 at start (its pod may still be pulling an image)."""


class _Refused(TransportError):
    """Some rollouts never accepted a weight round; `replicas` names them."""

    def __init__(self, message: str, replicas: frozenset[int]) -> None:
        super().__init__(message)
        self.replicas = replicas


class StaleBatch(RuntimeError):
    """A rollout answered with a batch older than `rollout.async.maxStaleness` allows; it is never trained on."""


class RolloutLink:
    """Actor rank 0's view of one rollout replica: its client, incarnation tag and last weights sent."""

    def __init__(self, replica: int, endpoint: str) -> None:
        self.replica = replica
        self.client = RequestClient(endpoint, timeout=2.0, retries=1)
        self.tag = ""
        self.version = -1
        self.restarts = 0


class Controller:
    """Rank 0's side of the loop: weights out, batches in."""

    def __init__(self, context: RoleContext, learner: PPOLearner) -> None:
        identity = context.identity
        spec = context.job.spec
        self.context = context
        self.learner = learner
        self.tag = process_tag()
        self.staleness = spec.rollout.async_.max_staleness
        self.publisher = WeightPublisher(
            identity.master_addr,
            identity.sync_port,
            self.tag,
            spec.rollout.weight_sync.bucket_size_mb,
        )
        self.links = [RolloutLink(i, e) for i, e in enumerate(identity.endpoints["rollout"])]
        self.log = context.log
        self.limited = LimitedLog(context.log)
        self.issue = ""
        """Why the last attempt at a step's batches failed; "" once a step's batches are in (progress reports it)."""
        self.late = LateReplicas(context.log)
        """Rollouts that stopped answering. Each holds its own environments, so its share of the batch cannot move
        to another: the step waits for it (up to ROLLOUT_WAIT_S), and the log, `/progress` and a Stalled
        condition name it meanwhile."""

    def close(self) -> None:
        self.publisher.close()
        for link in self.links:
            link.client.close()

    def _status(self, link: RolloutLink) -> None:
        asked = time.monotonic()
        name = f"rollout-{link.replica}"

        def not_answering(exc: Exception, _: object) -> None:
            if link.tag:  # it answered before: hung or cut off, not still starting
                self.late.late(name, asked, [])
            else:
                self.limited.warning(
                    f"status:{link.replica}:{reason_of(exc)}",
                    "rollout %d not answering (%s); waiting for it",
                    link.replica,
                    exc,
                )

        reply = retry(
            lambda: link.client.call("status"),
            retry_on=(RequestTimeout,),
            deadline_s=ROLLOUT_WAIT_S,
            stop=self.context.stop,
            on_retry=not_answering,
        )
        self.late.answered(name)
        if reply["tag"] != link.tag:
            if link.tag:
                link.restarts += 1
                self.log.warning("rollout %d restarted; sending it the weights again", link.replica)
            link.tag = reply["tag"]
            link.version = -1
            self.publisher.forget(link.replica)
        elif int(reply["version"]) < link.version:
            # Its receiving side lost a sync the broadcast completed (the rollout reports it): send them again.
            link.version = -1

    def sync(self, links: list[RolloutLink], version: int) -> None:
        """Send `version` to `links`; TransportError when any of them did not get it.

        When some never accept the round (still connecting, say), the others get `version` at once in a round
        without them: one slow member never holds the rest back.
        """
        for link in links:
            if not link.tag:
                self._status(link)
        try:
            self._sync_round(links, version)
        except _Refused as refused:
            others = [link for link in links if link.replica not in refused.replicas]
            if others:
                self._sync_round(others, version)
            raise TransportError(str(refused)) from None

    def _sync_round(self, links: list[RolloutLink], version: int) -> None:
        """One broadcast round to `links`."""
        keys = self.publisher.plan([(link.replica, link.tag) for link in links], version, self.learner.model)
        requests = [
            (
                link,
                link.client.send(
                    "sync_weights",
                    {"version": version, "key": keys[link.replica], "actor_tag": self.tag, "rollout_tag": link.tag},
                ),
            )
            for link in links
        ]
        try:
            self.publisher.publish(version, self.learner.model)
        except SyncRefused as exc:
            for link in links:
                self.publisher.forget(link.replica)
            raise _Refused(f"weight sync: {exc}", exc.replicas) from exc
        except RuntimeError as exc:  # torch.distributed errors: a rollout died mid-broadcast
            for link in links:
                self.publisher.forget(link.replica)
            raise TransportError(f"weight sync to rollouts {[link.replica for link in links]} failed: {exc}") from exc
        for link, request in requests:
            link.client.receive(request, timeout=30.0, retries=0)
            link.version = version

    def push(self, version: int) -> float:
        """Send the new weights right after an update, so rollouts collect while rank 0 logs and checkpoints.

        A failure here is left to `fetch`, which checks the replicas and syncs again.
        """
        started = time.perf_counter()
        behind = [link for link in self.links if link.version != version]
        if behind:
            try:
                self.sync(behind, version)
            except TransportError as exc:
                self.limited.warning(f"push:{reason_of(exc)}", "weight push failed (%s); fetch retries", exc)
        return time.perf_counter() - started

    def fetch(self, version: int) -> tuple[list[dict[str, Any]], float]:
        """One batch per rollout replica for the policy at `version`; (batches, seconds spent on weight sync).

        A failed attempt (a refused sync, a rollout that lost its weights or restarted) is retried after a
        jittered wait that grows while failures go on, and logged once per reason per interval: a peer that
        fails the same way on every attempt costs neither a busy loop nor a flooded log. `issue` says why
        meanwhile (progress reports it; the operator shows it on a Stalled job).
        """
        batches: dict[int, dict[str, Any]] = {}
        sync_s = 0.0
        backoff = Backoff(first_s=0.2, max_s=10.0)
        while len(batches) < len(self.links):
            self.context.heartbeat.beat()  # waiting for batches is alive; a request that never returns is not
            if self.context.stop.is_set():
                raise InterruptedError("stopping")
            pending = [link for link in self.links if link.replica not in batches]
            try:
                behind = [link for link in pending if link.version != version]
                if behind:
                    started = time.perf_counter()
                    self.sync(behind, version)
                    sync_s += time.perf_counter() - started
                requests = [
                    (
                        link,
                        link.client.send(
                            "collect",
                            {"actor_version": version, "max_staleness": self.staleness, "actor_tag": self.tag},
                        ),
                    )
                    for link in pending
                ]
                for link, request in requests:
                    reply = link.client.receive(request)
                    if reply["tag"] != link.tag:
                        self._status(link)
                    elif reply["ready"]:
                        self._check_staleness(link, reply, version)
                        batches[link.replica] = reply
            except TransportError as exc:
                self.issue = f"step {version + 1}: {exc}"
                self.limited.warning(
                    f"fetch:{reason_of(exc)}", "rollout request failed (%s); checking the rollout replicas", exc
                )
                for link in pending:
                    self._status(link)
                if self.context.stop.wait(backoff.next()):
                    raise InterruptedError("stopping") from None
        self.issue = ""
        return [batches[i] for i in range(len(self.links))], sync_s

    def _check_staleness(self, link: RolloutLink, reply: dict[str, Any], version: int) -> None:
        """Refuse a batch too old for the step it was fetched for, before anything trains on it.

        The rollout hands over only batches within the budget; one that does not is a broken peer, and the
        actor group is restarted rather than trained on data the staleness limit exists to keep out.
        """
        age = version - int(reply["version"])
        if age > self.staleness:
            raise StaleBatch(
                f"rollout {link.replica} sent a batch of policy version {reply['version']} for step {version}: "
                f"{age} versions old, over spec.rollout.async.maxStaleness ({self.staleness}); not trained on"
            )


def _share_batch(
    batch: GymBatch | None, shapes: dict[str, tuple[int, ...]], device: torch.device, src: int = 0
) -> GymBatch:
    """Send rank 0's batch to every rank as one flat float32 tensor (shapes are known everywhere)."""
    sizes = [math.prod(shapes[f]) for f in BATCH_FIELDS]
    if batch is not None:
        flat = torch.cat([getattr(batch, f).to(torch.float32).reshape(-1) for f in BATCH_FIELDS])
    else:
        flat = torch.empty(sum(sizes))
    flat = flat.to(device)  # NCCL moves CUDA tensors only
    dist.broadcast(flat, src)
    if batch is not None:
        return batch
    parts = torch.split(flat.cpu(), sizes)
    tensors = {f: p.reshape(shapes[f]) for f, p in zip(BATCH_FIELDS, parts, strict=True)}
    for f in ("terminated", "truncated"):
        tensors[f] = tensors[f].bool()
    if tensors["actions"].dtype != shapes.get("_action_dtype"):
        tensors["actions"] = tensors["actions"].to(shapes["_action_dtype"])  # type: ignore[arg-type]
    return GymBatch(**tensors)


def _to_batch(replies: list[dict[str, Any]]) -> GymBatch:
    """Concatenate the rollout replicas' [T, n_i, ...] arrays along the environment axis."""
    joined = {f: np.concatenate([r[f] for r in replies], axis=1) for f in BATCH_FIELDS}
    tensors = {f: torch.from_numpy(np.ascontiguousarray(joined[f])) for f in BATCH_FIELDS}
    return GymBatch(**tensors)


def restore_learner(learner: PPOLearner, state: dict[str, Any], path: str | Path) -> None:
    """Load a checkpoint's learner state; one written for another model is a `FatalConfigError`."""
    try:
        learner.load_state_dict(state["learner"])
    except (RuntimeError, KeyError, ValueError) as exc:
        if isinstance(exc, RuntimeError) and "Error(s) in loading state_dict" not in str(exc):
            raise  # not a shape or key mismatch (out of memory, say): a restart may well get past it
        # torch: "Error(s) in loading state_dict for ...:" then one line per mismatch; show the first.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].startswith("Error(s) in loading"):
            lines = lines[1:]
        detail = lines[0].rstrip(".") if lines else type(exc).__name__
        raise FatalConfigError(
            f"checkpoint {path} was written for a different model ({detail}): "
            "use a new --out (or another spec.checkpoint.dir) or set spec.checkpoint.resume: never"
        ) from None


def run_actor(context: RoleContext, build_policy: PolicyBuilder = build_builtin_policy) -> int:
    spec = context.job.spec
    identity = context.identity
    gym = spec.task.gym
    if gym is None:
        context.log.error("this runtime's actor trains gym tasks with ppo; task.type is %s", spec.task.type)
        return 1
    torch.set_num_threads(1)
    torch.distributions.Distribution.set_default_validate_args(False)
    rank, world = identity.rank, identity.world_size
    from rljob.runtime.wire.health import RoleHealth

    # The replica's health and metrics endpoint (its pod's readiness probe) is served by its local rank 0.
    health = RoleHealth(context, counters={}) if identity.local_rank == 0 else None
    actor = spec.roles.actor
    try:
        device = rank_device(actor.gpus_per_replica, identity.local_rank)
        if world > 1:
            join_actor_group(identity, device, GROUP_TIMEOUT_MINUTES)
            context.log.info(
                "rank %d of %d (local rank %d of %d) on %s",
                rank,
                world,
                identity.local_rank,
                identity.ranks_per_replica,
                device,
            )
        return _train(context, health, device, rank, world, build_policy)
    except InterruptedError:
        context.log.info("stopped before the first step: nothing to checkpoint")
        return EXIT_PREEMPTED
    except Diverged as exc:
        return diverged_exit(context, exc)
    except RuntimeError as exc:
        fatal = (
            None
            if isinstance(exc, FatalConfigError)
            else nccl_config_error(actor.replicas, actor.gpus_per_replica, exc)
        )
        if fatal is None:
            raise
        raise fatal from None
    finally:
        if health is not None:
            health.close()
        if world > 1 and dist.is_initialized():  # a failed rank: its peers fail on their next collective anyway
            dist.destroy_process_group()


def _train(
    context: RoleContext, health: Any, device: torch.device, rank: int, world: int, build_policy: PolicyBuilder
) -> int:
    spec = context.job.spec
    identity = context.identity
    gym = spec.task.gym
    assert gym is not None
    steps_per_batch = spec.trainer.batch_size // gym.num_envs
    if steps_per_batch * gym.num_envs != spec.trainer.batch_size:
        context.log.error(
            "trainer.batchSize (%d) must be a multiple of task.gym.numEnvs (%d)", spec.trainer.batch_size, gym.num_envs
        )
        return 1
    env0 = RequestClient(identity.endpoints["env"][0], timeout=5.0, retries=0)
    try:
        spaces = retry(
            lambda: env0.call("spaces"),
            retry_on=(RequestTimeout,),
            deadline_s=ENV_WAIT_S,
            stop=context.stop,
            on_retry=lambda exc, _: context.log.info("waiting for env replica 0"),
        )
    except RequestTimeout:
        context.log.error(
            "env replica 0 (%s) did not answer in %.0fs; exiting so the failure policy restarts the actor group",
            identity.endpoints["env"][0],
            ENV_WAIT_S,
        )
        return 1
    finally:
        env0.close()
    observation_space = space_from_wire(spaces["observation_space"])
    action_space = space_from_wire(spaces["action_space"])
    torch.manual_seed(spec.trainer.seed)
    try:
        model = build_policy(spec, observation_space, action_space).to(device)
    except UnsupportedSpaceError as exc:
        raise FatalConfigError(str(exc)) from None
    learner = PPOLearner(
        model,
        spec.algorithm,
        spec.trainer,
        rank=rank,
        world_size=world,
        stale_data=spec.rollout.async_.max_staleness > 0,
    )
    learner.check_batch(spec.trainer.batch_size)

    default_dir = str(Path(identity.run_dir) / "checkpoints") if identity.run_dir else "/checkpoints"
    checkpoint_dir = spec.checkpoint.dir or default_dir
    checkpoints = CheckpointManager(checkpoint_dir, keep=spec.checkpoint.keep)
    env_steps, episodes = 0, 0
    try:
        resumed = resolve_resume_across_ranks(spec.checkpoint.resume, checkpoints)
    except CheckpointError as exc:  # an explicit resume path that is missing or damaged: no restart fixes it
        raise FatalConfigError(str(exc)) from None
    if resumed is not None:
        step, state, path = resumed
        restore_learner(learner, state, path)
        restore_rng_state(state["rng"])
        env_steps, episodes = int(state["env_steps"]), int(state["episodes"])
        context.log.info("resumed from %s (step %d, %d env steps)", path, step, env_steps)

    shapes: dict[str, Any] = {
        "obs": (steps_per_batch, gym.num_envs, *observation_space.shape),
        "actions": (steps_per_batch, gym.num_envs, *model.action_shape),
        "_action_dtype": torch.int64 if model.discrete else torch.float32,
    }
    for f in ("logprobs", "values", "next_values", "rewards", "terminated", "truncated"):
        shapes[f] = (steps_per_batch, gym.num_envs)

    total = spec.trainer.steps
    if rank != 0:
        if health is not None:
            health.ready()
        stop = 0
        while learner.step < total and stop != STOP_NOW:
            context.heartbeat.beat()
            stop = agree_to_stop(int(context.stop.is_set()), device, world)
            if stop == STOP_NOW:
                break
            try:
                learner.update(_share_batch(None, shapes, device))
            except Diverged as exc:
                raise exc.with_checkpoint(checkpoints.checkpoints()) from None
            if stop:
                break
        learner.leave_group()
        if stop and learner.step < total:
            context.log.info("stopped at step %d, as every rank agreed; rank 0 checkpoints it", learner.step)
            return EXIT_PREEMPTED
        return 0

    assert health is not None  # global rank 0 is its replica's local rank 0
    controller = Controller(context, learner)
    tracker = ProgressTracker(
        total_steps=total,
        step=learner.step,
        issue=lambda: "; ".join(x for x in (controller.late.issue(), controller.issue) if x),
        late=controller.late.snapshot,
    )
    health.server.set_progress_provider(tracker.snapshot)
    run_metrics = None
    if identity.run_dir:
        jsonl = Path(identity.run_dir) / "metrics.jsonl"
        previous_wall = keep_records_until(jsonl, learner.step)
        run_metrics = RunMetrics(identity.run_dir, spec.logging.tensorboard, start_time=time.time() - previous_wall)
    trackers = start_trackers(context)
    health.ready()
    context.log.info("training %d steps from step %d (%d actor ranks)", total, learner.step, world)
    last_return: float | None = None
    stop = 0
    try:
        while learner.step < total:
            context.heartbeat.beat()
            step_started = time.perf_counter()
            version = learner.step
            try:
                replies, fetch_sync_s = controller.fetch(version)
            except InterruptedError:  # asked to stop while waiting for the step's data: the step is abandoned
                replies, fetch_sync_s = [], 0.0
            # Every rank at this boundary: go on, finish this step and stop, or stop now (no batch).
            stop = agree_to_stop(STOP_NOW if not replies else int(context.stop.is_set()), device, world)
            if stop == STOP_NOW:
                context.log.info("asked to stop while waiting for step %d's data: that step is abandoned", version + 1)
                break
            fetched = time.perf_counter()
            batch = _to_batch(replies)
            if world > 1:
                _share_batch(batch, shapes, device)
            try:
                stats = learner.update(batch)
            except Diverged as exc:  # nothing from this update is pushed to rollouts or checkpointed
                raise exc.with_checkpoint(checkpoints.checkpoints()) from None
            trained = time.perf_counter()
            # A stopping run pushes nothing: its rollouts may be stopping too, and its next step is the next group's.
            push_s = controller.push(learner.step) if learner.step < total and not stop else 0.0
            transitions = int(batch.rewards.numel())
            env_steps += transitions
            returns = np.concatenate([r["episode_returns"] for r in replies])
            lengths = np.concatenate([r["episode_lengths"] for r in replies])
            successes = np.concatenate([r["episode_successes"] for r in replies])
            episodes += len(returns)
            staleness = [version - int(r["version"]) for r in replies]  # within the budget: fetch checked
            collect_s = max(float(r["collect_s"]) for r in replies)
            step_s = trained - step_started
            record: dict[str, Any] = {
                ENV_STEPS: env_steps,
                RETURN_MEAN: float(returns.mean()) if len(returns) else None,
                LENGTH_MEAN: float(lengths.mean()) if len(lengths) else None,
                EPISODES: len(returns),
                SUCCESS_RATE: float(successes.mean()) if len(successes) else None,
                "episode_returns": [round(float(x), 3) for x in returns],
                POLICY_LOSS: stats["policy_loss"],
                VALUE_LOSS: stats["value_loss"],
                ENTROPY: stats["entropy"],
                APPROX_KL: stats["approx_kl"],
                CLIP_FRACTION: stats["clip_fraction"],
                EXPLAINED_VARIANCE: stats["explained_variance"],
                LEARNING_RATE: stats["learning_rate"],
                "loss": stats["loss"],
                "first_loss": stats["first_loss"],
                "grad_norm": stats["grad_norm"],
                ENV_STEPS_PER_S: transitions / step_s if step_s > 0 else None,
                STALENESS_MEAN: float(np.mean(staleness)),
                STALENESS_MAX: int(max(staleness)),
                "policy_version": version,
                "rollout_restarts": sum(link.restarts for link in controller.links),
                phase_key("rollout"): collect_s,
                phase_key("sync"): fetch_sync_s + push_s,
                phase_key("waiting"): max(0.0, fetched - step_started - fetch_sync_s),
                phase_key("train"): trained - fetched,
            }
            if run_metrics is not None:
                line = run_metrics.log(learner.step, record)
            else:
                line = {"step": learner.step, **record}
            trackers.log(learner.step, line)
            health.metrics.observe(line)
            if record[RETURN_MEAN] is not None:
                last_return = record[RETURN_MEAN]
            # A Gaussian policy's entropy is differential (it may be negative): no floor applies to it.
            tracker.update(learner.step, record[RETURN_MEAN], entropy=stats["entropy"] if model.discrete else None)
            if learner.step % 10 == 0 or learner.step == total:
                context.log.info(
                    "step %d/%d env_steps %d return %s",
                    learner.step,
                    total,
                    env_steps,
                    f"{last_return:.1f}" if last_return is not None else "-",
                )
            interval = spec.checkpoint.interval
            if (interval and (learner.step % interval == 0 or learner.step == total)) or stop:
                checkpoints.save(
                    learner.step,
                    {
                        "learner": learner.state_dict(),
                        "rng": capture_rng_state(),
                        "env_steps": env_steps,
                        "episodes": episodes,
                    },
                )
            if stop:
                break
        if stop == STOP_NOW and learner.step > 0 and learner.step not in dict(checkpoints.checkpoints()):
            # The abandoned step left nothing behind: the checkpoint is the last finished step's.
            state = {"learner": learner.state_dict(), "rng": capture_rng_state()}
            checkpoints.save(learner.step, {**state, "env_steps": env_steps, "episodes": episodes})
    finally:
        controller.close()
        if run_metrics is not None:
            run_metrics.close()
        trackers.close()
    learner.leave_group()
    if stop and learner.step < total:
        context.log.info(
            "stopped at step %d of %d (asked to stop): checkpoint in %s; the next actor group resumes at step %d",
            learner.step,
            total,
            checkpoint_dir,
            learner.step + 1,
        )
        return EXIT_PREEMPTED
    context.log.info("reached trainer.steps (%d); final return %s", total, last_return)
    return 0
