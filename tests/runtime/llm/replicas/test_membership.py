"""Elastic rollouts: actor rank 0's pool follows the rollout membership while training goes on.

The rollout replicas here are real generation servers (the rollout role's `GenerationServer` on a tiny HF
model, served over zmq on threads), the weights travel over real gloo pair groups, and the membership is a
file replaced atomically, as the kubelet replaces a mounted ConfigMap.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rljob.api.loading import load_job_file
from rljob.launch.local import free_ports
from rljob.runtime.llm.engines.base import Sampling, WeightSyncSettings
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.replicas.membership import MembershipError, RolloutMembership, members_document, parse_members
from rljob.runtime.llm.replicas.pool import ChunkResult, RolloutPool
from rljob.runtime.llm.rollout import GenerationServer
from rljob.runtime.weights.sync import WeightPublisher
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import RoleIdentity, local_identities, ports_needed
from rljob.runtime.wire.transport import RequestClient, RequestServer
from tests.runtime.llm.engines.test_engine import CPU, TASK, TINY

EXAMPLE = Path(__file__).parents[4] / "examples" / "grpo-tiny-arithmetic.yaml"
SAMPLING = Sampling(n=2, temperature=1.0, max_tokens=3).to_wire()


def write_members(path: Path, members: dict[int, str]) -> None:
    """Replace the file in one step (a new inode), as the kubelet swaps a ConfigMap volume's files."""
    staged = path.with_suffix(".tmp")
    staged.write_text(members_document(members))
    os.replace(staged, path)


# --- the membership document and file ---------------------------------------------------------------------


def test_the_document_round_trips_in_replica_order() -> None:
    text = members_document({2: "r-2.job:29600", 0: "r-0.job:29600"})
    assert parse_members(text) == {0: "r-0.job:29600", 2: "r-2.job:29600"}
    assert text.index("r-0.job") < text.index("r-2.job")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"replicas": []}', '"rollouts": [{"replica": N'),
        ('{"rollouts": [{"replica": -1, "endpoint": "a:1"}]}', "rollouts[0] needs a replica index >= 0"),
        ('{"rollouts": [{"replica": 0, "endpoint": "no-port"}]}', "host:port endpoint"),
        ('{"rollouts": [{"replica": 0, "endpoint": "a:1"}, {"replica": 0, "endpoint": "b:1"}]}', "listed twice"),
    ],
)
def test_a_malformed_document_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(MembershipError, match=message.replace("[", r"\[")):
        parse_members(text)


def test_without_a_file_the_members_are_the_identity_endpoints_once() -> None:
    membership = RolloutMembership(["127.0.0.1:5000", "127.0.0.1:5001"])
    assert membership.changed() == {0: "127.0.0.1:5000", 1: "127.0.0.1:5001"}
    assert membership.changed() is None


def test_an_empty_document_means_none_ready_yet_and_the_identity_endpoints_are_tried(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    write_members(path, {})  # the operator's document before any rollout pod is Ready
    membership = RolloutMembership(["static:1", "static:2"], str(path), check_interval_s=0)
    assert membership.changed() == {0: "static:1", 1: "static:2"}
    write_members(path, {1: "r-1:1"})
    assert membership.changed() == {1: "r-1:1"}


def test_the_file_is_followed_and_a_bad_write_keeps_the_members_known(tmp_path: Path, caplog) -> None:
    path = tmp_path / "rollouts.json"
    membership = RolloutMembership(["static:1"], str(path), check_interval_s=0)
    assert membership.changed() == {0: "static:1"}  # not written yet: the identity's list meanwhile
    write_members(path, {0: "r-0:1", 1: "r-1:1"})
    assert membership.changed() == {0: "r-0:1", 1: "r-1:1"}
    assert membership.changed() is None  # unchanged file: not even read again
    path.write_text("{")
    with caplog.at_level(logging.WARNING, logger="rljob.actor"):
        assert membership.changed() is None
    assert "ignored, keeping 2 replica(s): not JSON" in caplog.text
    write_members(path, {1: "r-1:1"})
    assert membership.changed() == {1: "r-1:1"}
    path.unlink()  # once the file was seen, only the file says who is in
    assert membership.changed() is None


# --- the pool over real generation servers ------------------------------------------------------------------


class RolloutReplica:
    """One rollout replica: the rollout role's generation server, its worker and its zmq server on threads."""

    def __init__(self, identity: RoleIdentity, job, model: torch.nn.Module, tokenizer) -> None:
        self.context = RoleContext(identity=identity, job=job, log=logging.getLogger(f"rollout-{identity.replica}"))
        self.engine = self.make_engine(copy.deepcopy(model), tokenizer)
        self.server = GenerationServer(self.context, self.engine)
        self.endpoint = identity.endpoints["rollout"][identity.replica]
        handlers = {
            "status": self.server.status,
            "sync_weights": self.server.sync_weights,
            "generate": self.server.generate,
            "results": self.server.results,
            "sleep": self.server.sleep,
            "wake": self.server.wake,
        }
        bound = threading.Event()

        def serve() -> None:
            transport = RequestServer(self.endpoint, handlers)
            bound.set()
            try:
                transport.serve(self.context.stop.is_set)
            finally:
                transport.close()

        self.threads = [
            threading.Thread(target=self.server.work, daemon=True),
            threading.Thread(target=self.server.receive, daemon=True),
            threading.Thread(target=serve),
        ]
        for thread in self.threads:
            thread.start()
        assert bound.wait(10)

    def make_engine(self, model: torch.nn.Module, tokenizer) -> HFEngine:
        return HFEngine(model, tokenizer, CPU, WeightSyncSettings.from_context(self.context))

    def reported_version(self) -> int:
        client = RequestClient(self.endpoint, timeout=5.0)
        try:
            return int(client.call("status")["version"])
        finally:
            client.close()

    def version_once_received(self, expected: int, within_s: float = 10.0) -> int:
        """The version it reports once its receiver thread finished taking in `expected` (the actor's
        broadcast completes before the rollout's thread records what arrived), or the last one seen."""
        deadline = time.monotonic() + within_s
        while (version := self.reported_version()) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return version

    def stop(self) -> None:
        self.context.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)


def tiny_policy():
    """The tiny policy every replica of these tests starts from, and its tokenizer."""
    from rljob.runtime.llm.data.rows import arithmetic_rows
    from rljob.runtime.llm.models.policy import load_policy

    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=CPU)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def run_step(pool: RolloutPool, prompts: list[list[int]], chunks: int, between=None) -> dict[int, ChunkResult]:
    """Send a step's chunks, call `between` (with them in flight), then poll until each came back exactly once."""
    for _ in range(chunks):
        pool.submit(prompts, SAMPLING, 1, meta="step")
    if between is not None:
        between()
    results: dict[int, ChunkResult] = {}
    for _ in range(2000):
        for result in pool.poll():
            assert result.chunk.id not in results, f"chunk {result.chunk.id} came back twice"
            results[result.chunk.id] = result
        if len(results) == chunks:
            assert pool.pending() == 0
            return results
    raise AssertionError(f"{chunks - len(results)} chunk(s) never came back")


def test_a_joining_replica_gets_the_current_weights_before_work_and_a_leaving_ones_chunks_are_resent(
    tmp_path: Path, policy
) -> None:
    model, tokenizer = policy
    actor_model = copy.deepcopy(model)
    job = load_job_file(EXAMPLE)
    replicas = {"actor": 1, "rollout": 3}
    identities = local_identities("el", replicas, str(EXAMPLE), free_ports(ports_needed(replicas)))
    rollout_ids = [i for i in identities if i.role == "rollout"]
    endpoints = rollout_ids[0].endpoints["rollout"]
    members_file = tmp_path / "rollouts.json"
    write_members(members_file, {0: endpoints[0], 1: endpoints[1]})
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")]

    running = {i: RolloutReplica(rollout_ids[i], job, model, tokenizer) for i in (0, 1)}
    actor = identities[0]
    publisher = WeightPublisher(actor.master_addr, actor.sync_port, "actor-a", bucket_mb=1)
    membership = RolloutMembership(endpoints, str(members_file), check_interval_s=0)
    pool = RolloutPool(membership, publisher, "actor-a")
    try:
        assert [link.replica for link in pool.links] == [0, 1]
        pool.sync(0, actor_model)
        with torch.no_grad():  # a training step: the policy moves on to version 1
            for p in actor_model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        pool.sync(1, actor_model)
        assert [r.version_once_received(1) for r in running.values()] == [1, 1]

        # Scaled up: replica 2 starts, becomes ready, and the operator lists it.
        running[2] = RolloutReplica(rollout_ids[2], job, model, tokenizer)
        write_members(members_file, dict(enumerate(endpoints)))
        pool.refresh()
        joined = pool.links[2]
        assert (joined.replica, joined.version, joined.inflight) == (2, 1, {})  # weights first, no work yet
        assert running[2].version_once_received(1) == 1
        results = run_step(pool, prompts, 6)
        assert {r.replica for r in results.values()} == {0, 1, 2}  # the joiner took its share
        assert {r.version for r in results.values()} == {1}
        for mine, theirs in zip(
            actor_model.state_dict().values(), running[2].server.engine.model.state_dict().values(), strict=True
        ):
            assert torch.equal(mine, theirs)  # it generated with exactly the actor's weights

        # Scaled down: replica 0 leaves the membership with chunks in flight; they are sent elsewhere.
        leaving: set[int] = set()

        def scale_down() -> None:
            leaving.update(pool.links[0].inflight)
            write_members(members_file, {1: endpoints[1], 2: endpoints[2]})

        results = run_step(pool, prompts, 6, between=scale_down)  # the step completes without replica 0
        assert leaving and [link.replica for link in pool.links] == [1, 2]
        assert {r.replica for r in results.values()} == {1, 2}
        assert pool.restarts == 0
    finally:
        pool.close()
        for replica in running.values():
            replica.stop()
