"""One worker per RLJob: observe, plan (rljob.operator.reconcile), act. Never crashes on a bad job.

kopf delivers RLJob events (handlers.py), the pod cache (podcache.py) pod events; each event wakes the job's
worker, which reconciles serially, so two reconciles of one job never race. A worker's first pass waits until
the cache has listed its namespace's pods: after an operator restart it already sees every pod.

The worker keeps the status it last wrote (the operator is the status's only writer) and two short-
lived memories a watch-based cache needs: pods it created but has not seen yet, and pods it deleted
that are still listed. Both expire, so a lost event costs a retry, never a stuck job.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from rljob.api import API_VERSION, KIND, InvalidRLJob, RLJob, validate_job
from rljob.api.loading import read_yaml_value
from rljob.api.status import TERMINAL_PHASES, Progress, RLJobStatus
from rljob.operator.admission import QUOTA_EXCEEDED, admission_problem, refused_for_quota
from rljob.operator.client import ApiError, KubeClient
from rljob.operator.eventlimit import EventBucket
from rljob.operator.fairness import FairSlots
from rljob.operator.manifests import build_children
from rljob.operator.manifests.config import restart_relevant
from rljob.operator.manifests.members import build_rollout_members
from rljob.operator.manifests.network import NETWORK_POLICY_API
from rljob.operator.manifests.secret import build_job_secret
from rljob.operator.manifests.upstream import default_upstream_claim, mount_upstream
from rljob.operator.metrics import OperatorMetrics
from rljob.operator.naming import (
    CONFIG_KEY,
    LABEL_JOB,
    LABEL_ROLE,
    isolation_policy_name,
    reward_egress_policy_name,
)
from rljob.operator.packed import PackedChildren
from rljob.operator.peering import PeeringGate
from rljob.operator.podcache import PodCache
from rljob.operator.podstate import PodState, observe_pod
from rljob.operator.progress import ProgressReader
from rljob.operator.reconcile import Observation, Plan, plan
from rljob.operator.settings import OperatorSettings
from rljob.operator.trace import PassTrace
from rljob.operator.upstream import UPSTREAM_RETRY_SECONDS, Upstream, first_fields, upstream_claim, upstream_wait

logger = logging.getLogger(__name__)

Key = tuple[str, str]
Raw = dict[str, Any]

REJECTED = (400, 403, 422)
"""Statuses of a create the server will not accept as is (quota, admission webhooks, pod security)."""
STORAGE_CLASSES_SECONDS = 5.0
"""The cluster's StorageClasses are read for all jobs at most this often: a burst of new jobs shares one LIST."""
ADMISSION_BACKOFF_MAX_SECONDS = 60.0
"""A job waiting for quota looks again after 1, 2, 4 ... seconds, at most this long (and at once when a
ResourceQuota of its namespace changes: its usage moves whenever pods come and go)."""


@dataclass(frozen=True)
class ControllerConfig:
    resync_seconds: float = 30.0
    """Reconcile every job at least this often, events or not."""
    live_read_seconds: float = 300.0
    """Read each job and its pods from the server, not kopf's caches, at least this often (and after every
    re-list), and check its other children (not watched) as often. The read is two LISTs, the pods' by label,
    the check a create and a GET per child: at 1,000 jobs a 30 s period would be about 400 requests a second."""
    progress_seconds: float = 10.0
    """Pull actor 0's progress at most this often."""
    expectation_seconds: float = 60.0
    """How long a created (deleted) pod may be missing from (still present in) the watch."""
    error_backoff_seconds: float = 5.0
    coalesce_seconds: float = 0.05
    """After an event, wait this long for more before reconciling."""
    max_concurrent_reconciles: int = 16
    """Reconcile passes running at once, the slots handed out round robin across namespaces (fairness.py)."""
    create_fanout: int = 16
    """At most this many creates (or deletes) of one pass in flight at once."""
    event_burst: int = 25
    """Events one RLJob may post at once; then one per `event_refill_seconds` (eventlimit.py)."""
    event_refill_seconds: float = 10.0
    watch_retry_seconds: float = 1.0
    """After the pod watch fails (the API server is unreachable, say): how long before it tries again."""
    peering_poll_seconds: float = 2.0
    """With peering: how often the peering objects are read to know whether this operator stands by (2 s:
    controller-runtime's leader-election retry period)."""


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def merge_patch_between(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch that turns `old` into `new` (None where a key disappears)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: Raw = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = merge_patch_between(old[key], value)
            if sub:
                patch[key] = sub
        elif old[key] != value:
            patch[key] = value
    return patch


def dump_status(status: RLJobStatus) -> Raw:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def load_status(raw: Any) -> RLJobStatus:
    """The status as last written; a status the operator cannot read starts afresh (it is derived anyway)."""
    if not isinstance(raw, dict):
        return RLJobStatus()
    try:
        return RLJobStatus.model_validate(raw, by_alias=True)
    except ValidationError:
        logger.warning("unreadable RLJob status, starting from an empty one: %s", raw)
        return RLJobStatus()


def controlled_by(raw: Raw, uid: str | None) -> bool:
    owners = raw["metadata"].get("ownerReferences") or []
    return any(o.get("controller") and o.get("uid") == uid for o in owners)


def parse_job(body: Raw) -> tuple[RLJob | None, InvalidRLJob | None]:
    try:
        return validate_job({k: v for k, v in body.items() if k != "status"}), None
    except InvalidRLJob as exc:
        return None, exc


class StaleStatus(Exception):
    """The status write met a newer object (409): the worker forgets what it knew and plans again."""


def _newer(old: Raw, new: Raw) -> bool:
    """Whether `new` is not older than `old` (resource versions compared as etcd's counters when they are)."""
    before = str(old.get("metadata", {}).get("resourceVersion") or "")
    after = str(new.get("metadata", {}).get("resourceVersion") or "")
    if old.get("metadata", {}).get("uid") != new.get("metadata", {}).get("uid"):
        return True
    return not (before.isdigit() and after.isdigit()) or int(after) >= int(before)


class JobGone(Exception):
    """The RLJob this worker reconciles no longer exists (or is another incarnation): stop before acting."""

    def __init__(self, fresh: Raw | None = None) -> None:
        super().__init__("the RLJob is gone")
        self.fresh = fresh
        """The namesake that replaced it, when one did."""


@dataclass
class ConfigSync:
    """What reading the children back found: whether the spec change needs new pods, and what to patch."""

    spec_changed: bool = False
    patches: list[tuple[Raw, Raw]] = field(default_factory=list)
    """(existing object, merge patch) to apply after the status is written."""
    failed: list[str] = field(default_factory=list)
    """`Kind/name: why` of children the server refused to create (a CRD that is not installed, a quota, an
    admission webhook): reported in status and an Event; the pass that creates them completes the sync."""
    storage_checked: bool = False
    """Whether the checkpoint claim's StorageClass was looked at (`storage_problem` is then current)."""
    storage_problem: str | None = None
    """Why the checkpoint claim will not bind (no StorageClass named and none is the cluster's default)."""
    foreign: list[str] = field(default_factory=list)
    """`Kind/name` of children whose name another owner holds (a deleted namesake's, until the garbage
    collector removes them): never adopted; the pass that finds none completes the sync."""


class JobWorker:
    """Reconciles one RLJob, one pass at a time, woken by events and timers."""

    def __init__(self, controller: Controller, key: Key, body: Raw) -> None:
        self.controller = controller
        self.key = key
        self.body = body
        self.wake = asyncio.Event()
        self.status: RLJobStatus | None = None
        self.written: Raw | None = None
        self.expected: dict[str, float] = {}
        self.deleting: dict[str, float] = {}
        self.synced_generation: int | None = None
        self.children_checked = 0.0
        """When the children (ConfigMap, Service, PodGroup, NetworkPolicy) were last found complete and this
        job's (monotonic): they are checked again every `live_read_seconds`, since nothing watches them."""
        self.claim_checked = 0.0
        """When (monotonic) the checkpoint claim was last found unable to bind or not: while it cannot, it is looked
        at again every `resync_seconds`."""
        self.last_progress = 0.0
        self.progress: Progress | None = None
        self.task: asyncio.Task[None] | None = None
        self.woken_at: float | None = time.perf_counter()
        """When (perf_counter) the first event since the last pass arrived; None: none did (a timer wakes it)."""
        self.trace: PassTrace | None = None
        self.event_bucket = EventBucket(controller.config.event_burst, controller.config.event_refill_seconds)
        self.built: tuple[Any, tuple[RLJob | None, InvalidRLJob | None, PackedChildren]] | None = None
        self.just_built: tuple[PackedChildren, dict[str, Raw], list[Raw]] | None = None
        """The children just built, unpacked: the pass that built them uses these instead of unpacking."""
        self.rejections: set[str] = set()
        self.members_written: list[int] | None = None
        """The rollout membership last written (llm jobs): unchanged, it is not written again."""
        self.confirmed = time.monotonic()
        """When the job and its pods were last read live (monotonic). The pod cache has listed the namespace before
        the first reconcile, so a new worker starts from a confirmed view."""
        self.confirm = False
        """Read the job and its pods live on the next pass (a watch gap: kopf or the pod cache listed again)."""
        self.vanished: set[str] = set()
        """uids of pods the cache still holds that a live read found gone (a DELETED event the cache has not seen
        yet): left out of this worker's view until the cache drops them too."""
        self.gone = False
        self.status_version: str | None = None
        """The job's resourceVersion at which `written` was the status on the server: the precondition of the
        next status write, so a write planned on a status someone changed since is refused (409)."""
        self.admission_attempts = 0
        """Passes in a row that found the job's pods not fitting the namespace's quotas: the back-off's exponent."""
        self.quota_refusal: tuple[str, str] | None = None
        self.quota_refusal_until = 0.0
        """After the server refused a pod for quota (a race with another job) and the pods created with it were
        deleted again: why, and until when (monotonic) the job waits before trying again."""
        self.quota_reads_denied = False
        self.storage_problem: str | None = None
        """Why the job's checkpoint claim will not bind, as the last children sync found (None: it will, or the job
        has none)."""
        self.last_valid: tuple[RLJob, PackedChildren] | None = None
        self.upstream_fields: dict[str, str] = {}
        self.upstream_claims: dict[str, str | None] = {}
        """The RLJobs whose exported models this job loads (`source: job`): the field naming each, and the claim
        each was mounted from when the children were built (rebuilt when one changes)."""
        """The job and children of the last spec that passed validation: a started job runs on with it when an
        edit passes the CRD but not rljob's validation."""

    def forget_state(self) -> None:
        """Drop everything this worker remembers of the job beyond what the server holds: on every standby
        transition (the active peer moved the job on meanwhile) and on a conflicting status write. The next pass
        reads the job and its pods live and starts from the status as written."""
        self.status = None
        self.written = None
        self.status_version = None
        self.synced_generation = None
        self.children_checked = 0.0
        self.members_written = None
        self.progress = None
        self.last_progress = 0.0
        self.expected = {}
        self.confirm = True

    @property
    def phase(self) -> str:
        status = self.status if self.status is not None else load_status(self.body.get("status"))
        return status.phase

    def nudge(self) -> None:
        """An event concerns the job: wake the worker, and remember when the first such event came."""
        if self.woken_at is None:
            self.woken_at = time.perf_counter()
        self.wake.set()

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"rljob {self.key[0]}/{self.key[1]}")

    def cancel(self) -> None:
        """Stop the worker without waiting for it (from an event handler)."""
        if self.task is not None:
            self.task.cancel()

    async def stop(self) -> None:
        self.cancel()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def run(self) -> None:
        while True:
            self.wake.clear()
            delay = await self.reconcile_safely()
            if self.gone:
                return
            # Not `asyncio.wait_for`: on Python 3.11 it returns instead of raising when the cancel of `stop` lands
            # in the same loop turn as a wake, and the worker then runs on with `stop` waiting on it for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.wake.wait()
                # Events come in bursts (a job's pods change together): take them in one pass.
                await asyncio.sleep(self.controller.config.coalesce_seconds)

    async def reconcile_safely(self) -> float:
        ctl = self.controller
        if ctl.standing_by():
            # A hot standby: the active replica owns the job. Woken at once when this one becomes active;
            # the resync timer keeps ticking meanwhile (each tick counted, so a standby is seen idling).
            ctl.metrics.standby_passes.inc()
            self.forget_state()
            return ctl.config.resync_seconds
        woken, self.woken_at = self.woken_at or time.perf_counter(), None
        await ctl.pods.ready(self.key[0])
        self.trace = trace = PassTrace(ctl.metrics.job_pass_seconds, self.key, woken)
        async with ctl.slots.slot(self.key[0]):
            trace.mark("slot")
            started = time.perf_counter()
            try:
                delay = await self.reconcile()
            except asyncio.CancelledError:
                raise
            except StaleStatus:
                logger.info("rljob %s/%s: the status changed under this operator; planning again", *self.key)
                self.forget_state()
                delay = ctl.config.coalesce_seconds
            except JobGone as gone:
                logger.info("rljob %s/%s: deleted; its worker stops", *self.key)
                self.gone = True
                ctl.forget(self, gone.fresh)
                return 0.0
            except ApiError as exc:
                ctl.metrics.reconcile_errors.inc()
                logger.warning("rljob %s/%s: API error, retrying: %s", *self.key, exc)
                delay = ctl.config.error_backoff_seconds
            except Exception:
                # A bug must not take the operator or other jobs down: log it, back off, retry.
                ctl.metrics.reconcile_errors.inc()
                logger.exception("rljob %s/%s: reconcile failed, retrying", *self.key)
                delay = ctl.config.error_backoff_seconds
            finally:
                ctl.metrics.reconcile_seconds.observe(time.perf_counter() - started)
                trace.finish()
        return delay

    def observed_pods(self, raws: list[Raw]) -> list[PodState]:
        now = time.monotonic()
        # A pod this operator deleted is remembered while it terminates (its grace period may outlast the
        # expectation), so it is never taken for one the cluster took away; one still listed without a
        # deletionTimestamp past the horizon lost its DELETE and is deleted again.
        terminating = {r["metadata"].get("uid") for r in raws if r["metadata"].get("deletionTimestamp")}
        self.deleting = {uid: t for uid, t in self.deleting.items() if t > now or uid in terminating}
        pods = []
        for raw in raws:
            pod = observe_pod(raw)
            if pod is None:
                continue
            if pod.uid in self.deleting and not pod.terminating:
                pod = replace(pod, terminating=True)
            pods.append(pod)
        seen = {p.name for p in pods}
        self.expected = {name: t for name, t in self.expected.items() if t > now and name not in seen}
        return pods

    async def reconcile(self) -> float | None:
        ctl = self.controller
        body = self.body
        meta = body["metadata"]
        namespace, name = self.key
        if meta.get("deletionTimestamp"):
            return None  # the garbage collector removes the children with the job
        if self.confirm or time.monotonic() - self.confirmed >= ctl.config.live_read_seconds:
            await self.read_live()  # before the status is loaded: after a standby it comes from here
            body = self.body
            meta = body["metadata"]
        if self.status is None:
            self.status = load_status(body.get("status"))
            self.written = body.get("status") or {}  # what the server holds: the base of the next patch
            self.status_version = meta.get("resourceVersion")
        job, invalid, packed = self.desired()
        just_built, self.just_built = self.just_built, None
        whole: list[tuple[dict[str, Raw], list[Raw]]] = []

        def children() -> tuple[dict[str, Raw], list[Raw]]:
            """The whole children (fresh dicts of this pass): as just built, else unpacked, once a pass."""
            if not whole:
                whole.append(just_built[1:] if just_built is not None and just_built[0] is packed else packed.unpack())
            return whole[0]

        refused = None
        if job is None and self.status.phase not in TERMINAL_PHASES:
            # An edit the CRD accepted and rljob refuses: a started job keeps its last valid spec.
            fallback = self.last_valid or await self.applied_spec()
            if fallback is not None:
                refused, invalid = invalid, None
                job, packed = fallback
        # Only pods this job controls: a look-alike label on someone else's pod, or a pod of a deleted
        # namesake the garbage collector has not removed yet, is never touched.
        indexed = ctl.pods_of(namespace, name)
        self.vanished &= {r["metadata"].get("uid") for r in indexed}
        raws = [
            r for r in indexed if controlled_by(r, meta.get("uid")) and r["metadata"].get("uid") not in self.vanished
        ]
        pods = self.observed_pods(raws)
        generation = int(meta.get("generation") or 1)

        sync = ConfigSync()
        active = self.status.phase not in TERMINAL_PHASES and job is not None and not job.spec.suspend
        # Children are not watched: looked at again every live read; the claim alone every resync while it cannot
        # bind (a default StorageClass may have been marked since).
        now = time.monotonic()
        recheck = now - self.children_checked >= ctl.config.live_read_seconds
        claim_due = self.storage_problem is not None and now - self.claim_checked >= ctl.config.resync_seconds
        if active and self.synced_generation == generation and not recheck and claim_due:
            claim = await self.recheck_claim(children()[1])
            if claim is None:
                recheck = True  # the claim is gone: made again with the other children, now
            else:
                sync = claim
        if active and (self.synced_generation != generation or recheck):
            sync = await self.sync_children(job, children()[1])
        if sync.storage_checked:
            self.storage_problem = sync.storage_problem
            self.claim_checked = now
        progress = await self.pull_progress(job, raws) if job is not None else None
        obs = Observation(
            job=job,
            invalid=invalid,
            generation=generation,
            status=self.status,
            pods=pods,
            desired_pods=packed.heads,  # the planner reads the pods' names and metadata only
            now=ctl.clock(),
            expected=set(self.expected),
            spec_changed=sync.spec_changed,
            progress=progress,
            foreign_children=sync.foreign,
            failed_children=sync.failed,
            refused_edit=refused,
            deleted=set(self.deleting),
            storage_problem=self.storage_problem if active else None,
        )
        result = plan(obs)
        # The whole pods only on a pass that creates some (most passes create none).
        desired_pods = children()[0] if result.create else {}
        if result.create and job is not None:
            # All of the pods this pass creates fit the namespace's quotas, or none is created (a partial gang
            # would hold its nodes while it waits for the rest).
            waiting = self.waiting_for_upstream()
            if waiting is not None:
                obs.admission, obs.admission_retry_seconds = waiting, UPSTREAM_RETRY_SECONDS
            else:
                obs.admission, obs.admission_retry_seconds = await self.check_admission(
                    [desired_pods[n] for n in result.create]
                )
            if obs.admission is not None:
                result = plan(obs)
        self.mark("planned")
        await self.write_status(result)  # the scaling's time and step first: a replay never scales twice
        # Before the pods (what `kubectl describe` lists explains what follows), all in one round trip.
        await self.post_events(result)
        if result.scale_rollouts is not None:
            await self.scale_rollouts(result.scale_rollouts)
        for existing, patch in sync.patches:
            await ctl.client.patch(
                existing["apiVersion"], existing["kind"], namespace, existing["metadata"]["name"], patch
            )
        if active and not sync.foreign and not sync.failed:
            if self.synced_generation != generation or recheck:
                self.children_checked = time.monotonic()
                self.members_written = None  # the membership ConfigMap is checked again with the others
            self.synced_generation = generation
        if job is not None and result.rollout_members is not None:
            # Before the pods are touched: a rollout deleted now has left the membership the actor reads.
            await self.write_members(job, result.rollout_members)
        refused = await self.act(result, pods, desired_pods)
        return ctl.config.coalesce_seconds if refused else self.next_delay(result)

    def mark(self, stage: str, log: bool = True) -> None:
        if self.trace is not None:
            self.trace.mark(stage, log)

    async def check_admission(self, pods: list[Raw]) -> tuple[tuple[str, str] | None, float]:
        """(reason, message) why `pods` may not be created now, and how soon to look again; (None, 0) when
        they all fit. Reads the namespace's ResourceQuotas and LimitRanges live (they are not watched in full)."""
        now = time.monotonic()
        if self.quota_refusal is not None and now < self.quota_refusal_until:
            return self.quota_refusal, self.quota_refusal_until - now
        self.quota_refusal = None
        client = self.controller.client
        try:
            quotas, ranges = await asyncio.gather(
                client.list("v1", "ResourceQuota", self.key[0]), client.list("v1", "LimitRange", self.key[0])
            )
        except ApiError as exc:
            if exc.status != 403:
                raise
            # An RBAC without these reads (an older chart): the server's quota admission still decides, and a
            # refused create rolls the pass's pods back (act).
            if not self.quota_reads_denied:
                logger.warning("rljob %s/%s: cannot read quotas, pods are created unchecked: %s", *self.key, exc)
            self.quota_reads_denied = True
            return None, 0.0
        problem = admission_problem(pods, quotas, ranges)
        if problem is None:
            self.admission_attempts = 0
            return None, 0.0
        return problem, self.admission_backoff()

    def admission_backoff(self) -> float:
        self.admission_attempts += 1
        return min(2.0 ** (self.admission_attempts - 1), ADMISSION_BACKOFF_MAX_SECONDS)

    async def read_live(self) -> None:
        """Read the job and its pods from the server, not from kopf's caches: every resync, and after kopf
        re-listed. A job deleted in a watch gap stops its worker (JobGone) before it acts; a pod deleted in
        the gap is dropped from this worker's view of the index (`vanished`)."""
        client = self.controller.client
        namespace, name = self.key
        before = {r["metadata"].get("uid") for r in self.controller.pods_of(namespace, name)}
        # A LIST by name, not a GET: the operator's RBAC grants list and watch on RLJobs.
        jobs = await client.list(API_VERSION, KIND, namespace, fields=f"metadata.name={name}")
        fresh = next((j for j in jobs if j.get("metadata", {}).get("name") == name), None)
        if fresh is None:
            raise JobGone()
        if fresh["metadata"].get("uid") != self.body["metadata"].get("uid"):
            raise JobGone(fresh)
        listed = await client.list("v1", "Pod", namespace, labels=f"{LABEL_JOB}={name}")
        self.vanished = before - {p["metadata"].get("uid") for p in listed}
        if self.vanished:
            logger.info("rljob %s/%s: %d pod(s) in the watch cache are gone", *self.key, len(self.vanished))
        self.body = fresh
        self.confirm = False
        self.confirmed = time.monotonic()

    def desired(self) -> tuple[RLJob | None, InvalidRLJob | None, PackedChildren]:
        """The validated job and its children, rebuilt only when the spec changes (a new generation) or the actor
        group restarted (its pods are told which restart they are: `RLJOB_RESTART`, the trackers' run names)."""
        meta = self.body["metadata"]
        restarts = int((self.body.get("status") or {}).get("restarts") or 0)
        key = (meta.get("uid"), meta.get("generation"), restarts)
        moved = self.upstream_fields and self.controller.upstream_claims(self.key[0], self.upstream_fields) != (
            self.upstream_claims
        )
        if self.built is None or self.built[0] != key or moved:
            self.built = (key, self.build())
            job, _, packed = self.built[1]
            if job is not None:
                self.last_valid = (job, packed)
        return self.built[1]

    def build(self) -> tuple[RLJob | None, InvalidRLJob | None, PackedChildren]:
        """The job validated and its children built, packed (see `desired`)."""
        restarts = int((self.body.get("status") or {}).get("restarts") or 0)
        job, invalid = parse_job(self.body)
        if job is not None and restarts:
            job.status = RLJobStatus(restarts=restarts)
        if job is not None:
            job = self.mount_upstream(job)
        desired_pods: dict[str, Raw] = {}
        others: list[Raw] = []
        if job is not None:
            try:
                desired_pods, others = self.children_of(job)
            except InvalidRLJob as exc:
                job, invalid, desired_pods, others = None, exc, {}, []
        packed = PackedChildren(desired_pods, others)
        self.just_built = (packed, desired_pods, others)
        return job, invalid, packed

    def mount_upstream(self, job: RLJob) -> RLJob:
        """`job` reading the models of the RLJobs it names (`source: job`) from their claims, mounted read-only."""
        ctl = self.controller
        self.upstream_fields = first_fields(job)
        if not self.upstream_fields:
            return job
        self.upstream_claims = ctl.upstream_claims(self.key[0], self.upstream_fields)
        for name in self.upstream_fields:
            ctl.dependents.setdefault((self.key[0], name), set()).add(self.key)
        claims = {name: claim or default_upstream_claim(name) for name, claim in self.upstream_claims.items()}
        return mount_upstream(job, claims)

    def waiting_for_upstream(self) -> tuple[str, str] | None:
        """Why the pods may not start yet (an upstream RLJob has not succeeded), or None."""
        if not self.upstream_fields:
            return None
        namespace = self.key[0]
        ups = [
            Upstream(name, field, self.controller.upstream_phase(namespace, name), self.upstream_claims.get(name))
            for name, field in self.upstream_fields.items()
        ]
        return upstream_wait(namespace, ups)

    def children_of(self, job: RLJob) -> tuple[dict[str, Raw], list[Raw]]:
        """The pods (by name) and the other children the builders make for `job`."""
        desired_pods: dict[str, Raw] = {}
        # The job's transport key: drawn here (builders stay pure), written once; an existing Secret is kept.
        others: list[Raw] = [build_job_secret(job, secrets.token_hex(32).encode())]
        for child in build_children(job, self.controller.settings):
            if child["kind"] == "Pod":
                desired_pods[child["metadata"]["name"]] = child
            else:
                others.append(child)
        return desired_pods, others

    async def applied_spec(self) -> tuple[RLJob, PackedChildren] | None:
        """The last valid spec as the job's ConfigMap holds it (after an operator restart, say); None for a job
        that never had one (created invalid: it fails as InvalidSpec)."""
        namespace, name = self.key
        try:
            existing = await self.controller.client.get("v1", "ConfigMap", namespace, f"{name}-config")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        if not controlled_by(existing, self.body["metadata"].get("uid")):
            return None
        document = read_yaml_value((existing.get("data") or {}).get(CONFIG_KEY) or "{}") or {}
        if not isinstance(document.get("spec"), dict):
            return None
        body = {k: v for k, v in self.body.items() if k not in ("spec", "status")}
        job, _ = parse_job({**body, "spec": document["spec"]})
        if job is None:
            return None
        try:
            desired_pods, others = self.children_of(job)
        except InvalidRLJob:
            return None
        self.last_valid = (job, PackedChildren(desired_pods, others))
        return self.last_valid

    async def sync_children(self, job: RLJob, others: list[Raw]) -> ConfigSync:
        """Create the ConfigMap, Service, PodGroup and NetworkPolicy if absent; read back what exists to spot
        spec edits (and follow them: a PodGroup's or NetworkPolicy's spec, a NetworkPolicy no longer needed)."""
        ctl = self.controller
        namespace = self.key[0]
        sync = ConfigSync()
        edited: list[bool] = []
        fanout = asyncio.Semaphore(ctl.config.create_fanout)

        async def one(manifest: Raw) -> None:
            name = manifest["metadata"]["name"]
            try:
                async with fanout:
                    made = await ctl.client.create(namespace, manifest)
                if manifest["kind"] == "PersistentVolumeClaim":
                    await self.check_claim(made, sync)
                return
            except ApiError as exc:
                if exc.status == 0:
                    raise  # the server is unreachable: nothing else will get through either
                if not exc.exists:
                    sync.failed.append(f"{manifest['kind']}/{name}: {_create_error(manifest, exc)}")
                    return
            existing = await ctl.client.get(manifest["apiVersion"], manifest["kind"], namespace, name)
            if manifest["kind"] == "PersistentVolumeClaim":
                await self.check_claim(existing, sync)
            if not controlled_by(existing, self.body["metadata"].get("uid")) and not _retained_claim(existing, job):
                # A namesake's (a deleted job of the same name whose children the garbage collector has not
                # removed yet, or a stranger's): adopting it would lose it a moment later. Wait until it is gone.
                sync.foreign.append(f"{manifest['kind']}/{name}")
                return
            if manifest["kind"] == "ConfigMap":
                old = read_yaml_value((existing.get("data") or {}).get(CONFIG_KEY) or "{}") or {}
                new = read_yaml_value(manifest["data"][CONFIG_KEY])
                if old.get("spec") != new.get("spec"):
                    sync.spec_changed = restart_relevant(old.get("spec") or {}) != restart_relevant(new["spec"])
                    sync.patches.append((existing, {"data": manifest["data"]}))
                    edited.append(True)
            elif manifest["kind"] == "PodGroup":
                patch = merge_patch_between(existing.get("spec") or {}, manifest.get("spec") or {})
                patch = {k: v for k, v in patch.items() if v is not None}
                if patch:
                    sync.patches.append((existing, {"spec": patch}))
            elif manifest["kind"] == "NetworkPolicy" and existing.get("spec") != manifest["spec"]:
                sync.patches.append((existing, {"spec": manifest["spec"]}))

        # Together: the children do not depend on each other, and the pods wait for all of them.
        await _gather(one(manifest) for manifest in others)
        if edited:
            await self.delete_unneeded_policies(job, others)
        return sync

    async def recheck_claim(self, others: list[Raw]) -> ConfigSync | None:
        """Whether the checkpoint claim, found unable to bind, can bind now: the claim read back, not every child
        created again (jobs waiting for a default StorageClass would otherwise cost 11 requests each every resync:
        about 400 a second at 1,000 jobs). None when the claim is gone (or the spec has none any more)."""
        claim = next((m for m in others if m["kind"] == "PersistentVolumeClaim"), None)
        if claim is None:
            return None
        name = claim["metadata"]["name"]
        try:
            existing = await self.controller.client.get("v1", "PersistentVolumeClaim", self.key[0], name)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        sync = ConfigSync()
        await self.check_claim(existing, sync)
        return sync

    async def check_claim(self, claim: Raw, sync: ConfigSync) -> None:
        """Whether the checkpoint claim can bind: it names a StorageClass, is bound, or the cluster has a default
        StorageClass (which a claim without a class gets, also one made before the default was set)."""
        sync.storage_checked = True
        spec, phase = claim.get("spec") or {}, (claim.get("status") or {}).get("phase")
        if spec.get("storageClassName") or spec.get("volumeName") or phase == "Bound":
            return
        try:
            classes = await self.controller.storage_classes()
        except ApiError as exc:
            if exc.status in (403, 404):
                sync.storage_checked = False  # cannot tell: say nothing rather than guess
                return
            raise
        if any(_default_class(c) for c in classes):
            return
        name = claim["metadata"]["name"]
        sync.storage_problem = (
            f"the checkpoint claim {name} names no StorageClass and the cluster has no default one, so it stays "
            "unbound and the actor pods Pending: set spec.checkpoint.storage.storageClassName (or the chart's "
            "jobDefaults.checkpointStorage.storageClassName), mark a default StorageClass, name a claim of your own "
            "in spec.checkpoint.volumeClaim, or set spec.checkpoint.storage.persistent: false"
        )

    async def delete_unneeded_policies(self, job: RLJob, others: list[Raw]) -> None:
        """After a spec edit that leaves the job without sandboxed rewards (or gives them network), or switches
        its isolation off: the policies this job made and no longer needs go. A namesake the job does not control
        is left alone."""
        client = self.controller.client
        wanted = {m["metadata"]["name"] for m in others if m["kind"] == "NetworkPolicy"}
        for name in (reward_egress_policy_name(job), isolation_policy_name(job)):
            if name in wanted:
                continue
            try:
                existing = await client.get(NETWORK_POLICY_API, "NetworkPolicy", self.key[0], name)
                if controlled_by(existing, self.body["metadata"].get("uid")):
                    uid = existing["metadata"]["uid"]
                    await client.delete(NETWORK_POLICY_API, "NetworkPolicy", self.key[0], name, uid=uid)
            except ApiError as exc:
                if not exc.not_found:
                    raise

    async def scale_rollouts(self, replicas: int) -> None:
        """The autoscaler's count, through the scale subresource; the new generation then creates or deletes
        rollout pods (and the actor follows the membership) like a hand `kubectl scale`."""
        try:
            await self.controller.client.scale_job(*self.key, replicas)
        except ApiError as exc:
            if exc.not_found:
                return  # deleted meanwhile
            logger.warning("rljob %s/%s: cannot scale rollouts to %d: %s", *self.key, replicas, exc)

    async def write_members(self, job: RLJob, members: list[int]) -> None:
        """Keep the job's rollout membership ConfigMap equal to `members` (created when absent)."""
        if members == self.members_written:
            return
        ctl = self.controller
        manifest = build_rollout_members(job, members)
        name = manifest["metadata"]["name"]
        try:
            await ctl.client.create(self.key[0], manifest)
        except ApiError as exc:
            if not exc.exists:
                raise
            existing = await ctl.client.get("v1", "ConfigMap", self.key[0], name)
            if not controlled_by(existing, self.body["metadata"].get("uid")):
                return  # a deleted namesake's, until the garbage collector removes it: tried again next pass
            if existing.get("data") != manifest["data"]:
                await ctl.client.patch("v1", "ConfigMap", self.key[0], name, {"data": manifest["data"]})
        self.members_written = list(members)

    async def pull_progress(self, job: RLJob, raws: list[Raw]) -> Progress | None:
        ctl = self.controller
        now = time.monotonic()
        if now - self.last_progress < ctl.config.progress_seconds:
            return None
        actor0 = next(
            (
                r
                for r in raws
                if r["metadata"]["labels"].get(LABEL_ROLE) == "actor"
                and r["metadata"]["labels"].get("rljob.io/replica") == "0"
                and (r.get("status") or {}).get("phase") == "Running"
                and not r["metadata"].get("deletionTimestamp")
            ),
            None,
        )
        if actor0 is None:
            return None
        self.last_progress = now
        return await ctl.progress.read(actor0, job.spec.logging.prometheus_port)

    async def write_status(self, result: Plan) -> None:
        new = dump_status(result.status)
        if new == self.written:
            self.status = result.status
            return
        patch = merge_patch_between(self.written or {}, new)
        # Preconditions: the status this plan started from is the one the server holds (another replica, or
        # this one before a standby, may have written since), and the job is the same incarnation.
        meta = self.body["metadata"]
        preconditions = {"uid": meta.get("uid"), "resourceVersion": self.status_version}
        try:
            updated = await self.controller.client.patch_job_status(
                *self.key, patch, {k: v for k, v in preconditions.items() if v}
            )
        except ApiError as exc:
            if exc.not_found:
                raise JobGone() from None  # deleted: nothing of this plan may be carried out
            if exc.exists:
                raise StaleStatus() from None  # nothing of this plan may be carried out either
            raise
        self.mark("status_written")
        self.status = result.status
        self.written = new
        self.status_version = (updated.get("metadata") or {}).get("resourceVersion")
        if updated.get("metadata") and _newer(self.body, updated):
            self.body = updated

    async def post_events(self, result: Plan) -> None:
        """Post the pass's Events together, as many as the job's rate limit lets through (eventlimit.py)."""
        ctl = self.controller

        async def post(event: Any) -> None:
            try:
                await ctl.client.post_event(self.body, event.type, event.reason, event.message, ctl.clock())
            except ApiError as exc:
                logger.warning("rljob %s/%s: cannot post event %s: %s", *self.key, event.reason, exc)

        posts = []
        for event in result.events:
            logger.info("rljob %s/%s: %s %s", *self.key, event.reason, event.message)
            if self.event_bucket.allow(time.monotonic()):
                posts.append(post(event))
            else:
                ctl.metrics.events_suppressed.inc()
        await asyncio.gather(*posts)

    async def act(self, result: Plan, pods: list[PodState], desired: dict[str, Raw]) -> bool:
        """Carry out the plan; True when the server refused a pod for quota and this pass's pods were deleted."""
        ctl = self.controller
        namespace = self.key[0]
        by_name = {p.name: p for p in pods}
        horizon = time.monotonic() + ctl.config.expectation_seconds

        async def delete(name: str) -> None:
            pod = by_name[name]
            try:
                async with fanout:
                    await ctl.client.delete("v1", "Pod", namespace, name, uid=pod.uid)
            except ApiError as exc:
                if exc.status not in (404, 409):  # gone already, or a newer pod took the name
                    raise
            self.deleting[pod.uid] = horizon

        created: dict[str, str] = {}
        over_quota: list[str] = []
        fanout = asyncio.Semaphore(ctl.config.create_fanout)

        async def create(name: str) -> None:
            try:
                async with fanout:
                    made = await ctl.client.create(namespace, desired[name])
            except ApiError as exc:
                if exc.status == 403 and refused_for_quota(str(exc)):
                    over_quota.append(str(exc))
                    return
                if exc.status in REJECTED:
                    await self.report_rejection(name, exc)
                    return
                if not exc.exists:
                    raise
            else:
                created[name] = (made.get("metadata") or {}).get("uid") or ""
                self.mark("pod_created", log=False)
            self.expected[name] = horizon

        await _gather(delete(n) for n in result.delete if n in by_name)
        await _gather(create(n) for n in result.create)
        if created:
            self.mark("pods_created")
        if over_quota:
            await self.roll_back(created, over_quota[0], len(result.create))
        for role, reason in result.replaced:
            ctl.metrics.replacements.labels(role, reason).inc()
        if result.restart_counted:
            ctl.metrics.restarts.labels("true").inc()
        elif any(role == "actor" for role, _ in result.replaced):
            ctl.metrics.restarts.labels("false").inc()
        if result.delete_job:
            try:
                await ctl.client.delete(API_VERSION, KIND, *self.key, uid=self.body["metadata"].get("uid"))
            except ApiError as exc:
                if exc.status not in (404, 409):
                    raise
        return bool(over_quota)

    async def roll_back(self, created: dict[str, str], refusal: str, attempted: int) -> None:
        """The server refused a pod for quota although the check passed (another job took the quota meanwhile):
        delete the pods this pass created, so none holds a node waiting for the rest, and wait with back-off."""
        client = self.controller.client
        horizon = time.monotonic() + self.controller.config.expectation_seconds
        for name, uid in created.items():
            try:
                await client.delete("v1", "Pod", self.key[0], name, uid=uid or None)
            except ApiError as exc:
                if exc.status not in (404, 409):
                    raise
            self.expected.pop(name, None)
            if uid:
                self.deleting[uid] = horizon
        message = (
            f"{attempted} pods not created: the server refused one for quota ({refusal}); "
            f"the {len(created)} created with it were deleted again"
        )
        logger.warning("rljob %s/%s: %s", *self.key, message)
        delay = self.admission_backoff()
        self.quota_refusal = (QUOTA_EXCEEDED, message)
        self.quota_refusal_until = time.monotonic() + delay

    async def report_rejection(self, name: str, exc: ApiError) -> None:
        """The server refused a pod (quota, admission, policy): say so once per distinct reason, as the
        Job controller does with FailedCreate; the next reconcile tries again."""
        message = f"{name}: {exc}"
        if message in self.rejections:
            return
        self.rejections.add(message)
        logger.warning("rljob %s/%s: pod rejected: %s", *self.key, message)
        try:
            await self.controller.client.post_event(self.body, "Warning", "FailedCreate", message, utcnow())
        except ApiError as post_error:
            logger.warning("rljob %s/%s: cannot post event FailedCreate: %s", *self.key, post_error)

    def next_delay(self, result: Plan) -> float:
        ctl = self.controller
        delays = [ctl.config.resync_seconds]
        if result.requeue_after is not None:
            delays.append(result.requeue_after + 0.05)
        if result.status.phase in ("Starting", "Running"):
            delays.append(ctl.config.progress_seconds)
        if self.expected or self.deleting:
            now = time.monotonic()
            delays.append(max(min(list(self.expected.values()) + list(self.deleting.values())) - now, 0.05))
        return max(min(delays), 0.0)


DEFAULT_CLASS_ANNOTATIONS = (
    "storageclass.kubernetes.io/is-default-class",
    "storageclass.beta.kubernetes.io/is-default-class",
)


def _default_class(storage_class: Raw) -> bool:
    annotations = (storage_class.get("metadata") or {}).get("annotations") or {}
    return any(annotations.get(key) == "true" for key in DEFAULT_CLASS_ANNOTATIONS)


def _retained_claim(existing: Raw, job: RLJob) -> bool:
    """A checkpoint claim kept from an earlier job of this name (`checkpoint.storage.retain`): no owner, this job's
    label. The job mounts it again and resumes from its checkpoints."""
    meta = existing.get("metadata") or {}
    return (
        existing.get("kind", "PersistentVolumeClaim") == "PersistentVolumeClaim"
        and not meta.get("ownerReferences")
        and (meta.get("labels") or {}).get(LABEL_JOB) == job.name
        and (meta.get("labels") or {}).get("app.kubernetes.io/component") == "checkpoints"
    )


def _create_error(manifest: Raw, exc: ApiError) -> str:
    """Why a child could not be created, with the likely cause of a 404 on a create (an API not served)."""
    if exc.not_found:
        group = manifest["apiVersion"].split("/")[0] if "/" in manifest["apiVersion"] else "core"
        return (
            f"{exc} (the cluster does not serve {manifest['kind']} of {manifest['apiVersion']}: is {group} installed?)"
        )
    return str(exc)


async def _gather(calls: Iterable[Any]) -> None:
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


class Controller:
    """Holds the workers of every RLJob in view, the shared client, progress reader and metrics."""

    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        progress: ProgressReader | None = None,
        config: ControllerConfig | None = None,
        clock: Callable[[], datetime.datetime] = utcnow,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.progress = progress or ProgressReader()
        self.config = config or ControllerConfig()
        self.clock = clock
        self.slots = FairSlots(self.config.max_concurrent_reconciles)
        metrics.reconcile_queue.set_function(self.slots.queued)
        self.workers: dict[Key, JobWorker] = {}
        self.dependents: dict[Key, set[Key]] = {}
        """Jobs that load an RLJob's exported model (`source: job`), by that RLJob: woken by its events."""
        self.pods = PodCache(client, self.pod_event, self.config.watch_retry_seconds)
        self.classes: tuple[float, asyncio.Future[list[Raw]]] | None = None
        """When the StorageClasses were last asked for, and the answer (shared by every job asking meanwhile)."""
        self.pods_task: asyncio.Task[None] | None = None
        self.peering: PeeringGate | None = None
        """With kopf peering: says when this operator stands by (see rljob/operator/peering.py)."""
        self.peering_task: asyncio.Task[None] | None = None
        """The task keeping `peering` fresh (`watch_peering`): stopped with the workers, before the client closes."""
        metrics.watch_state(self._phases, self._pod_phases)
        metrics.watch_jobs(self._statuses)

    def pods_of(self, namespace: str, job: str) -> list[Raw]:
        return self.pods.pods_of(namespace, job)

    async def storage_classes(self) -> list[Raw]:
        """The cluster's StorageClasses, at most `STORAGE_CLASSES_SECONDS` old; a failed read is not kept."""
        now = time.monotonic()
        if self.classes is None or now - self.classes[0] >= STORAGE_CLASSES_SECONDS:
            read = asyncio.ensure_future(self.client.list_cluster("storage.k8s.io/v1", "StorageClass"))
            self.classes = (now, read)
        read = self.classes[1]
        try:
            return await asyncio.shield(read)  # a waiter cancelled does not cancel the others' read
        except ApiError:
            if self.classes is not None and self.classes[1] is read:
                self.classes = None
            raise

    def follow_pods(self, namespaces: Iterable[str] = (), all_namespaces: bool = False) -> None:
        """Start keeping the pod cache current (stopped with the workers)."""
        self.pods_task = self.pods.start(namespaces, all_namespaces)

    def forget(self, worker: JobWorker, fresh: Raw | None = None) -> None:
        """A worker found its job gone: drop it (from inside its own task); start one for a namesake."""
        if self.workers.get(worker.key) is worker:
            del self.workers[worker.key]
        if fresh is not None:
            self.job_event(None, fresh)

    def job_event(self, event_type: str | None, body: Raw) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        worker = self.workers.get(key)
        if event_type is None and worker is not None:
            worker.confirm = True  # kopf listed (again): what vanished meanwhile has no DELETED event
        if event_type == "DELETED":
            if worker is not None:
                del self.workers[key]
                worker.cancel()
            return
        if worker is None or worker.body["metadata"].get("uid") != meta.get("uid"):
            if worker is not None:
                worker.cancel()
            worker = self.workers[key] = JobWorker(self, key, body)
            worker.start()
            return
        if _newer(worker.body, body):
            worker.body = body  # an event older than what a status write answered tells nothing new
        self.wake_dependents(key)
        if event_type == "MODIFIED" and worker.status_version and meta.get("resourceVersion") == worker.status_version:
            return  # the echo of the worker's own status write: the write's answer was this very object
        worker.nudge()

    def wake_dependents(self, key: Key) -> None:
        """An RLJob changed (it may have succeeded): the jobs waiting for its exported model look again."""
        for dependent in self.dependents.get(key, ()):
            waiting = self.workers.get(dependent)
            if waiting is not None:
                waiting.nudge()

    def upstream_claims(self, namespace: str, names: Iterable[str]) -> dict[str, str | None]:
        """The checkpoint claim each named RLJob exports its model to, as its last valid spec says."""
        claims = {}
        for name in names:
            worker = self.workers.get((namespace, name))
            upstream = worker.last_valid[0] if worker is not None and worker.last_valid is not None else None
            claims[name] = upstream_claim(upstream, name)
        return claims

    def upstream_phase(self, namespace: str, name: str) -> str | None:
        """The phase of RLJob `name` as this operator sees it; None: there is none."""
        worker = self.workers.get((namespace, name))
        return worker.phase if worker is not None else None

    def quota_changed(self, namespace: str) -> None:
        """A ResourceQuota of the namespace changed (raised, or its usage moved as pods came and went): the
        jobs there that wait for quota look again now."""
        for key, worker in list(self.workers.items()):
            if key[0] == namespace and worker.admission_attempts:
                worker.nudge()

    def standing_by(self) -> bool:
        return self.peering is not None and self.peering.paused

    def peering_changed(self) -> None:
        """The standby state changed: record it, and wake every worker (they idle while standing by). Either way
        each worker forgets its cached status: the active peer wrote meanwhile, or will from now on."""
        self.metrics.standby.set(1 if self.standing_by() else 0)
        for worker in list(self.workers.values()):
            worker.forget_state()
            worker.nudge()

    async def watch_peering(self, namespaces: Iterable[str] = ()) -> None:
        """Keep the peering gate fresh (until cancelled): the served namespaces and those with jobs."""
        assert self.peering is not None
        fixed = {n for n in namespaces if not any(c in n for c in "*?[!")}
        await self.peering.run(lambda: fixed | {key[0] for key in self.workers}, self.peering_changed)

    def pod_event(self, namespace: str, job: str, listed: bool = False) -> None:
        """A pod of the job changed; `listed`: a LIST found it (a re-list after a watch gap, or the start)."""
        worker = self.workers.get((namespace, job))
        if worker is not None:
            worker.confirm = worker.confirm or listed
            worker.nudge()

    async def stop(self) -> None:
        """Stop every worker and close the HTTP sessions (idempotent)."""
        workers, self.workers = list(self.workers.values()), {}
        for task in (self.peering_task, self.pods_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for worker in workers:
            await worker.stop()
        await self.progress.close()
        await self.client.close()

    def _phases(self) -> list[str]:
        return [w.phase for w in list(self.workers.values())]

    def _statuses(self) -> list[tuple[str, str, RLJobStatus]]:
        # The status as the API server has it (the watched body), not the one this replica last wrote: a
        # hot standby then exports the same series as the active operator, and alerts dedupe them.
        return [(*key, load_status(w.body.get("status"))) for key, w in list(self.workers.items())]

    def _pod_phases(self) -> list[tuple[str, str]]:
        pods: list[tuple[str, str]] = []
        for key in list(self.workers):
            for raw in self.pods_of(*key):
                role = raw["metadata"]["labels"].get(LABEL_ROLE, "")
                pods.append((role, (raw.get("status") or {}).get("phase") or "Pending"))
        return pods
