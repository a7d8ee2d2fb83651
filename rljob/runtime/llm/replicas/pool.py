"""Actor rank 0's view of the servers it feeds: rollout replicas (generation) and reward replicas (scoring).

`RolloutPool` hands chunks of prompts to the least-loaded rollout replica, collects what they finished, and
re-sends the chunks of a replica that died or restarted (noticed by its new incarnation tag) to the others:
no chunk is lost and none is counted twice. Weights go to every replica whose version is behind.

The replicas are those of a `RolloutMembership` (rljob/runtime/llm/replicas/membership.py), looked at between polls:
a replica that joins gets the latest weights before any chunk is sent to it (chunks only go to replicas
holding weights), and the chunks in flight on a replica that leaves are re-sent to the others.

A replica that does not answer a request within the role's deadline (`LatencyDeadline`: from the observed
latency, or `spec.roles.<role>.requestTimeoutSeconds`) is late (`LateReplicas`): named in the log and in
`/progress`, its work re-sent to the others, and none sent to it until it answers a `status` probe again.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rljob.runtime.llm.replicas.membership import RolloutMembership
from rljob.runtime.process.log_limit import LimitedLog, reason_of
from rljob.runtime.weights.ipc import IpcWeightPublisher
from rljob.runtime.weights.sync import FileWeightPublisher, SyncRefused, WeightPublisher
from rljob.runtime.wire.deadlines import FLOOR_S, LatencyDeadline, LateReplicas
from rljob.runtime.wire.transport import Payload, RequestClient, RequestTimeout, TransportError

log = logging.getLogger("rljob.actor")
limited = LimitedLog(log)
SYNC_REPLY_TIMEOUT_S = 60.0
REVIVE_INTERVAL_S = 1.0
"""How often, while chunks wait for a replica, the replicas without weights are asked whether they are back."""
SLEEP_TIMEOUT_S = 600.0
"""How long the actor waits for a collocated rollout to free its GPU memory (it ends its chunk in progress first)."""
SLEEP_NOTICE_S = 60.0
"""How often the actor says, while it waits for a collocated rollout to sleep, what it waits for."""


TURN_REPLY_TIMEOUT_S = 10.0
"""A collocated rollout answers `sleep` and `wake` within a fraction of a second (its generating thread does the
work): no answer in this long means it is gone, not busy."""


class RolloutAwake(RuntimeError):
    """A collocated rollout did not free its GPU memory in time: training beside its engine could run out of it."""


class RolloutAsleep(RuntimeError):
    """A collocated rollout did not take its GPU memory back in time: it cannot take weights in or generate."""


@dataclass
class Chunk:
    """Prompts sent together to one replica; `meta` is the caller's (e.g. which rows and which group)."""

    id: int
    prompts: list[list[int]]
    sampling: dict[str, Any]
    min_version: int
    meta: Any = None
    rows: list[dict[str, Any]] | None = None
    """The prompts' dataset rows, sent along for a text environment (multi-turn episodes); None otherwise."""
    vision: Any = None
    """The prompts' images, in prompt order (`rljob.runtime.llm.data.images.VisionInputs`), for a vision-language
    policy: sent as two raw array frames, never re-encoded."""


@dataclass
class ChunkResult:
    chunk: Chunk
    version: int
    completions: list[list[dict[str, Any]]]
    seconds: float
    replica: int


@dataclass
class RolloutLink:
    replica: int
    endpoint: str
    client: RequestClient
    tag: str = ""
    version: int = -1
    restarts: int = 0
    inflight: dict[int, Chunk] = field(default_factory=dict)


class RolloutPool:
    def __init__(
        self,
        membership: RolloutMembership | list[str],
        publisher: WeightPublisher | FileWeightPublisher | IpcWeightPublisher,
        actor_tag: str,
        late: LateReplicas | None = None,
        deadline: LatencyDeadline | None = None,
    ) -> None:
        self.late = late or LateReplicas(log)
        """Replicas that stopped answering (named in the log and `/progress`): no work and no weights until they
        answer a `status` probe again."""
        self.deadline = deadline or LatencyDeadline("rollout", first_s=FLOOR_S["rollout"])
        """How long a `results` or `status` request may go unanswered (answered by the rollout's server thread
        whatever it generates: milliseconds when all is well)."""
        self._probes: dict[int, tuple[int, float]] = {}
        """Late replica -> (its pending `status` probe, when last sent)."""
        self._rejoining: set[int] = set()
        """Replicas that answered again and wait for the latest weights before they get chunks."""
        self.membership = membership if isinstance(membership, RolloutMembership) else RolloutMembership(membership)
        self.links: list[RolloutLink] = []
        """The current members, by replica index."""
        self.publisher = publisher
        self.actor_tag = actor_tag
        self._ids = itertools.count(1)
        self.orphans: list[Chunk] = []
        """Chunks of a replica that went away, waiting for a live one."""
        self._weights: tuple[int, torch.nn.Module] | None = None
        """The latest (version, model) synced: what a replica that comes back, or joins, gets."""
        self._next_revive = 0.0
        self._retired_restarts = 0
        """Restarts of replicas that left the membership: `restarts` never goes down."""
        self.issue = ""
        """Why the last weight round left replicas without the weights; "" once every live replica has them."""
        self.refresh()

    def close(self) -> None:
        self.publisher.close()
        for link in self.links:
            link.client.close()

    @property
    def restarts(self) -> int:
        return self._retired_restarts + sum(link.restarts for link in self.links)

    def refresh(self) -> None:
        """Follow the membership: joiners get the latest weights now, leavers' chunks in flight are re-sent."""
        members = self.membership.changed()
        if members is None:
            return
        kept = []
        for link in self.links:
            if members.get(link.replica) == link.endpoint:
                kept.append(link)
            else:
                self._retire(link)
        known = {link.replica for link in kept}
        joined = [
            RolloutLink(replica, endpoint, RequestClient(endpoint, timeout=2.0, retries=1))
            for replica, endpoint in sorted(members.items())
            if replica not in known
        ]
        self.links = sorted(kept + joined, key=lambda link: link.replica)
        if self._weights is None or not joined:
            return  # before the first sync: the first `sync` reaches joiners like every other replica
        for link in joined:
            log.info(
                "rollout %d (%s) joined: sending it weights version %d", link.replica, link.endpoint, self._weights[0]
            )
        self._sync_links([link for link in joined if self._check(link)], *self._weights)

    def _retire(self, link: RolloutLink) -> None:
        log.info("rollout %d (%s) left the rollout membership", link.replica, link.endpoint)
        self.late.forget(_name(link))
        self._probes.pop(link.replica, None)
        self._lose(link, "left")
        self._retired_restarts += link.restarts
        link.client.close()
        self.publisher.forget(link.replica)

    def _check(self, link: RolloutLink) -> bool:
        """Refresh the replica's incarnation; False when it does not answer (named late when it had answered
        before: one never reached is still starting). A new incarnation loses its chunks."""
        if self.late.is_late(_name(link)):
            return False  # its probe says when it is back (`_probe_late`): no status timeout paid per call
        asked = time.monotonic()
        try:
            reply = link.client.call("status", timeout=self.deadline.seconds(), retries=0)
        except TransportError:
            if link.tag:
                self._name_late(link, asked)
            else:
                self._lose(link, "not answering")
            return False
        self.deadline.observe(time.monotonic() - asked)
        self._seen(link, reply)
        return True

    def _name_late(self, link: RolloutLink, since: float) -> None:
        """`link` has not answered since `since`: named, its chunks re-sent to the others, no work until its
        `status` probe is answered (`_probe_late`)."""
        others = [_name(x) for x in self.links if x is not link and x.tag and not self.late.is_late(_name(x))]
        self.late.late(_name(link), since, others)
        self._lose(link, "not answering")

    def _probe_late(self) -> None:
        """Late replicas that answered their `status` probe rejoin (a restarted one as a new incarnation); the
        others are probed afresh once per deadline. Never blocks."""
        for link in self.links:
            if not self.late.is_late(_name(link)):
                continue
            probe = self._probes.get(link.replica)
            if probe is None:
                self._probes[link.replica] = (link.client.send("status"), time.monotonic())
                continue
            try:
                reply = link.client.wait(probe[0], 0)
            except TransportError:
                reply = None
            if reply is not None:
                link.client.forget(probe[0])
                del self._probes[link.replica]
                self.late.answered(_name(link))
                self._rejoining.add(link.replica)
                self._seen(link, reply)
            elif time.monotonic() - probe[1] >= self.deadline.seconds():
                link.client.resend(probe[0])  # on a fresh socket: a restarted replica never got the first
                self._probes[link.replica] = (probe[0], time.monotonic())

    def _seen(self, link: RolloutLink, reply: Payload) -> None:
        """A `status` answer: a new incarnation loses its chunks and weights."""
        if reply["tag"] != link.tag:
            if link.tag:
                link.restarts += 1
                self._lose(link, "restarted")
            link.tag, link.version = reply["tag"], -1
            self.publisher.forget(link.replica)
        return True

    def _lose(self, link: RolloutLink, why: str) -> None:
        if link.inflight:
            log.warning("rollout %d %s: re-sending its %d chunk(s) elsewhere", link.replica, why, len(link.inflight))
        self.orphans.extend(link.inflight.values())
        link.inflight.clear()
        link.version = -1

    def sync(self, version: int, model: torch.nn.Module) -> float:
        """Send weights `version` to every live replica that lacks them, in one broadcast; seconds spent."""
        started = time.perf_counter()
        self._weights = (version, model)
        self.refresh()
        self._probe_late()
        behind = [
            link
            for link in self.links
            if link.version != version
            # A replica never reached, or lost, answers a status request first: a dead one costs no sync timeout.
            and ((link.tag and link.version >= 0) or self._check(link))
        ]
        self._sync_links(behind, version, model)
        return time.perf_counter() - started

    def _sync_links(self, links: list[RolloutLink], version: int, model: torch.nn.Module) -> None:
        """One round to all of `links`; when some never accept, one more round to the others."""
        for _ in range(2):
            if not links:
                return
            keys = self.publisher.plan([(link.replica, link.tag) for link in links], version, model)
            requests = {}
            sent = time.monotonic()
            for link in links:
                request = {"version": version, "key": keys[link.replica], "actor_tag": self.actor_tag}
                requests[link.replica] = link.client.send("sync_weights", request | {"rollout_tag": link.tag})
            refused: frozenset[int] = frozenset()
            failure: Exception | None = None
            try:
                self.publisher.publish(version, model)
            except SyncRefused as exc:
                refused = exc.replicas
                self.issue = f"weights version {version}: {exc}"
                limited.warning(f"refused:{reason_of(exc)}", "%s; syncing the others without them", exc)
            except RuntimeError as exc:  # a member died mid-broadcast: check them all, sync later
                failure = exc
                self.issue = f"weights version {version}: {exc}"
                replicas = [link.replica for link in links]
                limited.warning(f"failed:{reason_of(exc)}", "weight sync to rollouts %s failed (%s)", replicas, exc)
            # A refused round is called off for every member (the publisher aborts it): nobody got `version`.
            published = failure is None and not refused
            for link in links:
                # One that took part may be loading a large model's weights; one that never accepted only has
                # to say so: past the request deadline it is late (a frozen one must not cost a minute a step).
                timeout = self.deadline.seconds() if link.replica in refused else SYNC_REPLY_TIMEOUT_S
                try:
                    link.client.receive(requests[link.replica], timeout=timeout, retries=0)
                except TransportError as exc:  # gone, or restarted: check it, sync later
                    reason = f"reply:{link.replica}:{reason_of(exc)}"
                    limited.warning(reason, "weight sync to rollout %d failed (%s)", link.replica, exc)
                    if link.tag and isinstance(exc, RequestTimeout):
                        self._name_late(link, sent)
                    refused |= {link.replica}
                    continue
                if published and link.replica not in refused:
                    link.version = version
                    if link.replica in self._rejoining:
                        self._rejoining.discard(link.replica)
                        log.info("%s has weights version %d again: it takes chunks again", _name(link), version)
            for link in links:
                if link.replica in refused or failure is not None:
                    self.publisher.forget(link.replica)
                    self._check(link)
            if failure is None and not refused:
                self.issue = ""
            if failure is not None or not refused:
                return
            links = [link for link in links if link.version != version and link.replica not in refused]

    def sleep(self) -> float:
        """Have every live replica free its GPU memory (collocated rollouts, before the actor trains); seconds.

        A replica ends the chunk it is generating first (a leftover one, say): it answers at once whether it is
        asleep and is asked again until it is, for `SLEEP_TIMEOUT_S` at most; then `RolloutAwake`."""
        return self._take_turns("sleep", asleep=True)

    def wake(self) -> float:
        """Have every live replica take its GPU memory back (before weights and generation); seconds.

        Asked as `sleep` is, until each says it is awake (`SLEEP_TIMEOUT_S` at most; then `RolloutAsleep`)."""
        return self._take_turns("wake", asleep=False)

    def _take_turns(self, method: str, asleep: bool) -> float:
        """Ask every live replica to `method` until each says `asleep` is as wanted. A replica that does not
        answer within TURN_REPLY_TIMEOUT_S is checked: one that answers its status (late, or restarted) is asked
        again; one that does not is gone and left out (it is synced when it is back), so a dead rollout costs
        seconds, not a reply timeout."""
        started = time.perf_counter()
        deadline = time.monotonic() + SLEEP_TIMEOUT_S
        notice = time.monotonic() + SLEEP_NOTICE_S
        waiting = [link for link in self.links if link.tag]
        while waiting:
            requests = [(link, link.client.send(method, {"actor_tag": self.actor_tag})) for link in waiting]
            behind: list[tuple[RolloutLink, float]] = []
            for link, request in requests:
                try:
                    reply = link.client.receive(request, timeout=TURN_REPLY_TIMEOUT_S, retries=0)
                except TransportError as exc:
                    reason = f"{method}:{link.replica}:{reason_of(exc)}"
                    limited.warning(reason, "rollout %d: %s failed (%s)", link.replica, method, exc)
                    if self._check(link):  # late, or a new incarnation (it starts awake): ask it again
                        behind.append((link, 0.0))
                    continue
                if reply["asleep"] != asleep:
                    behind.append((link, float(reply.get("generating_s", 0.0))))
            waiting = [link for link, _ in behind]
            if not behind:
                break
            now = time.monotonic()
            if now >= deadline or now >= notice:
                link, generating_s = behind[0]
                if asleep:
                    what = (
                        f"it is still generating a chunk it started {generating_s:.0f}s ago"
                        if generating_s
                        else "it has not slept its engine yet"
                    )
                    if now >= deadline:
                        raise RolloutAwake(
                            f"rollout {link.replica} did not free its GPU memory within {SLEEP_TIMEOUT_S:g}s: "
                            f"{what}; the actor does not train beside an awake engine on the GPUs they share"
                        )
                    log.warning("rollout %d: training waits for it to sleep: %s", link.replica, what)
                else:
                    if now >= deadline:
                        raise RolloutAsleep(
                            f"rollout {link.replica} did not take its GPU memory back within {SLEEP_TIMEOUT_S:g}s "
                            "(its engine's wake has not returned): see its log"
                        )
                    log.warning("rollout %d: generation waits for its engine to wake", link.replica)
                notice = now + SLEEP_NOTICE_S
        return time.perf_counter() - started

    def _revive(self) -> None:
        """Give the latest weights to replicas that lost theirs (restarted, or gone and back) and answer now.

        Chunks only go to replicas holding weights; without this, chunks orphaned mid-step by the only
        replica would wait for the next `sync`, which comes after the step they belong to: never.
        """
        if self._weights is None or time.monotonic() < self._next_revive:
            return
        self._next_revive = time.monotonic() + REVIVE_INTERVAL_S
        version, model = self._weights
        self._sync_links([link for link in self.links if link.version < 0 and self._check(link)], version, model)

    def submit(
        self,
        prompts: list[list[int]],
        sampling: dict[str, Any],
        min_version: int,
        meta: Any,
        rows: list[dict[str, Any]] | None = None,
        vision: Any = None,
    ) -> None:
        self.orphans.append(Chunk(next(self._ids), prompts, sampling, min_version, meta, rows, vision))
        self._dispatch()

    def _dispatch(self) -> None:
        while self.orphans:
            live = [link for link in self.links if link.tag and link.version >= 0]
            if not live:
                return
            link = min(live, key=lambda x: (len(x.inflight), x.replica))
            chunk = self.orphans.pop(0)
            payload = {
                "id": chunk.id,
                "prompts": chunk.prompts,
                "sampling": chunk.sampling,
                "min_version": chunk.min_version,
                "actor_tag": self.actor_tag,
            }
            if chunk.rows is not None:
                payload["rows"] = chunk.rows
            if chunk.vision is not None:
                payload.update(chunk.vision.to_wire())
            try:
                reply = link.client.call("generate", payload)
            except TransportError:
                self.orphans.insert(0, chunk)
                self._check(link)
                continue
            if reply["tag"] != link.tag or not reply["accepted"]:
                self.orphans.insert(0, chunk)
                self._check(link)
                if link.version < 0:
                    continue
                return  # accepted nothing though current: try again on the next poll
            link.inflight[chunk.id] = chunk

    def poll(self) -> list[ChunkResult]:
        """Finished chunks from every replica with work (waiting briefly); re-dispatches lost ones."""
        self.refresh()
        self._probe_late()
        self._dispatch()
        if self.orphans:  # no replica can take them: see whether one came back
            self._revive()
            self._dispatch()
        busy = [link for link in self.links if link.inflight]
        requests = []
        for link in busy:
            requests.append((link, link.client.send("results", {"actor_tag": self.actor_tag}), time.monotonic()))
        finished: list[ChunkResult] = []
        for link, request, sent in requests:
            # Sent together, answered in parallel: the wait for one is time the others had too.
            try:
                reply = link.client.receive(
                    request, timeout=max(0.0, sent + self.deadline.seconds() - time.monotonic()), retries=0
                )
            except RequestTimeout:
                self._name_late(link, sent)  # its chunks go to the others; its late results are dropped
                continue
            self.deadline.observe(time.monotonic() - sent)
            if reply["tag"] != link.tag:
                self._check(link)
                continue
            for result in reply["results"]:
                chunk = link.inflight.pop(int(result["id"]), None)
                if chunk is not None:
                    finished.append(
                        ChunkResult(
                            chunk, int(result["version"]), result["completions"], result["seconds"], link.replica
                        )
                    )
        if not busy:
            time.sleep(0.05)
        return finished

    def pending(self) -> int:
        return len(self.orphans) + sum(len(link.inflight) for link in self.links)


def _name(link: RolloutLink) -> str:
    return f"rollout-{link.replica}"


class RewardPool:
    """Scores samples on the reward replicas: the batch is split evenly over those answering, scored in parallel.

    Each part has a deadline (`LatencyDeadline`, from the role's observed latency). A replica past it is named
    (`LateReplicas`) and its part is split over the others at once; its late answer, if it comes, is dropped
    (the request is forgotten), so no sample is scored twice into a batch. A late replica gets no work until it
    answers a `status` probe again. With no other replica to take the part, the late one is waited for (the
    request resent under the same id: a server that has it already answers from its cache) and still named.
    """

    def __init__(self, endpoints: list[str], deadline: LatencyDeadline, late: LateReplicas) -> None:
        self.clients = [RequestClient(e, timeout=deadline.first_s, retries=2) for e in endpoints]
        self.names = [f"reward-{i}" for i in range(len(endpoints))]
        self.deadline = deadline
        self.late = late
        self._probes: dict[int, tuple[int, float]] = {}
        """Late replica -> (its pending `status` probe, when last sent)."""

    def _check_late(self) -> None:
        """Late replicas that answered their probe rejoin; the others are probed (afresh once per deadline)."""
        for replica, name in enumerate(self.names):
            if not self.late.is_late(name):
                continue
            client = self.clients[replica]
            probe = self._probes.get(replica)
            if probe is None:
                self._probes[replica] = (client.send("status"), time.monotonic())
                continue
            try:
                answered = client.wait(probe[0], 0) is not None
            except TransportError:
                answered = True  # it answered, with an error: it is there
            if answered:
                client.forget(probe[0])
                del self._probes[replica]
                self.late.answered(name)
            elif time.monotonic() - probe[1] >= self.deadline.seconds():
                client.resend(probe[0])  # a fresh socket: a restarted replica never got the first one
                self._probes[replica] = (probe[0], time.monotonic())

    def score(
        self, samples: list[dict[str, Any]]
    ) -> tuple[np.ndarray, dict[str, list[float]], dict[str, int], dict[str, int]]:
        """Rewards, each term's values, each term's failed calls and each judge's outputs without a score."""
        self._check_late()
        everyone = list(range(len(self.clients)))
        answering = [r for r in everyone if not self.late.is_late(self.names[r])] or everyone

        def send(replica: int, part: np.ndarray) -> tuple[int, np.ndarray, int, float, bool]:
            request = self.clients[replica].send("score", {"samples": [samples[i] for i in part]})
            return replica, part, request, time.monotonic(), False

        def split(indices: np.ndarray, replicas: list[int]) -> list[tuple[int, np.ndarray, int, float, bool]]:
            parts = np.array_split(indices, len(replicas))
            return [send(r, part) for r, part in zip(replicas, parts, strict=True) if len(part)]

        outstanding = split(np.arange(len(samples)), answering)
        replies: list[tuple[np.ndarray, Payload]] = []
        while outstanding:
            replica, part, request, sent, overdue = outstanding.pop(0)
            client, name = self.clients[replica], self.names[replica]
            # Parts were sent together and are scored in parallel: waiting for one is time the others had too.
            try:
                reply = client.wait(request, max(0.0, sent + self.deadline.seconds() - time.monotonic()))
            except TransportError:
                client.forget(request)
                raise
            if reply is not None:
                client.forget(request)
                if not overdue:  # a frozen replica's 45 s is not the role's pace
                    self.deadline.observe(time.monotonic() - sent)
                self.late.answered(name)
                replies.append((part, reply))
                continue
            others = [r for r in answering if r != replica and not self.late.is_late(self.names[r])]
            self.late.late(name, sent, [self.names[r] for r in others])
            if not others:  # nowhere to move it: wait on
                client.resend(request)
                outstanding.append((replica, part, request, time.monotonic(), True))
                continue
            client.forget(request)  # its late answer is dropped: the part is scored elsewhere
            outstanding.extend(split(part, others))
        rewards = np.zeros(len(samples))
        terms: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        unparsed: dict[str, int] = {}
        for part, reply in replies:  # parts come back in any order: each goes to its samples' places
            rewards[part] = np.asarray(reply["rewards"], dtype=np.float64)
            for name, values in reply["terms"].items():
                column = terms.setdefault(name, [0.0] * len(samples))
                for i, value in zip(part.tolist(), values, strict=True):
                    column[i] = value
            for name, count in reply["errors"].items():
                errors[name] = errors.get(name, 0) + int(count)
            for name, count in reply.get("unparsed", {}).items():
                unparsed[name] = unparsed.get(name, 0) + int(count)
        return rewards, terms, errors, unparsed

    def close(self) -> None:
        for client in self.clients:
            client.close()
