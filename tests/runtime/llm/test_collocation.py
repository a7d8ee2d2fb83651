"""A collocated rollout (`roles.rollout.collocated`): weights by ipc, sleep while the actor trains, wake before work.

The rollout is the rollout role's real `GenerationServer` on a tiny HF model, served over zmq on threads; the actor
side is actor rank 0's `RolloutPool` with the ipc publisher, whose CPU handles are real shared memory (the CUDA
ones: tests/gpu/test_cuda_ipc.py).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from rljob.api import validate_job
from rljob.launch.local import free_ports
from rljob.runtime.identity import local_identities, ports_needed
from rljob.runtime.llm import pool as pool_module
from rljob.runtime.llm.engine import Completion, HFEngine, Sampling, WeightSyncSettings
from rljob.runtime.llm.pool import RolloutAsleep, RolloutAwake, RolloutPool
from rljob.runtime.transport import RequestClient
from rljob.runtime.weight_ipc import IpcWeightPublisher
from tests.runtime.llm.test_engine import CPU
from tests.runtime.llm.test_membership import RolloutReplica, run_step, tiny_policy

EXAMPLE = Path(__file__).parents[3] / "examples" / "grpo-tiny-arithmetic.yaml"
SAMPLING = Sampling(n=2, max_tokens=3).to_wire()


def collocated_job():
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"]["roles"]["rollout"]["collocated"] = True
    data["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    return validate_job(data)


class RecordingEngine(HFEngine):
    """The hf engine, writing down when it generates, sleeps and wakes (the order is what is tested)."""

    events: list[str]
    gate: threading.Event | None = None
    """When set: a chunk ends only once the test opens the gate (a chunk that runs as long as the test wants)."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self.events.append("generate")
        try:
            if self.gate is not None:
                assert self.gate.wait(60), "the test never let the chunk end"
            return super().generate(prompts, sampling)
        finally:
            self.events.append("generated")

    def sleep(self) -> None:
        super().sleep()
        self.events.append("sleep")

    wake_gate: threading.Event | None = None
    """When set: a wake returns only once the test opens it (vLLM's wake of a large model takes seconds)."""

    def wake(self) -> None:
        if self.wake_gate is not None:
            assert self.wake_gate.wait(60), "the test never let the wake end"
        super().wake()
        self.events.append("wake")


class CollocatedRollout(RolloutReplica):
    """The rollout role's server over a recording hf engine that sleeps and wakes (collocated)."""

    def make_engine(self, model: torch.nn.Module, tokenizer) -> RecordingEngine:
        settings = WeightSyncSettings.from_context(self.context)
        engine = RecordingEngine(model, tokenizer, CPU, settings, collocated=True)
        engine.events = []
        return engine


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def start_collocated_rollout(model: torch.nn.Module, tokenizer) -> CollocatedRollout:
    replicas = {"actor": 1, "rollout": 1}
    identities = local_identities("co", replicas, str(EXAMPLE), free_ports(ports_needed(replicas)))
    return CollocatedRollout(next(i for i in identities if i.role == "rollout"), collocated_job(), model, tokenizer)


def assert_engine_holds(engine: HFEngine, actor: torch.nn.Module) -> None:
    engine.swap_in()
    for mine, theirs in zip(engine.model.state_dict().values(), actor.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_actor_s_turns_sleep_train_wake_sync_generate_reach_the_rollout_in_order(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    actor_model = copy.deepcopy(model)
    with torch.no_grad():  # the actor's weights differ from the rollout's starting ones until a sync
        for p in actor_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    pool = RolloutPool(rollout.context.identity.endpoints["rollout"], publisher, "actor-a")
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")]
    try:
        pool.sync(1, actor_model)  # version 1 through shared memory, loaded before `sync` returns
        assert pool.links[0].version == 1
        assert {r.version for r in run_step(pool, prompts, 2).values()} == {1}

        pool.sleep()  # the actor is about to train
        assert rollout.server.asleep
        with torch.no_grad():  # the update
            for p in actor_model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        # Work sent to a sleeping rollout that holds the weights it asks for waits for it to wake (a collocated
        # actor never sends it: it wakes the rollout first; here it shows that no chunk starts while asleep).
        pool.submit(prompts, Sampling(n=2, max_tokens=3).to_wire(), 1, meta="early")
        for _ in range(3):
            assert pool.poll() == []
        pool.wake()
        pool.sync(2, actor_model)
        results = []
        while not results:
            results = pool.poll()
        assert [r.chunk.meta for r in results] == ["early"]
        assert {r.version for r in run_step(pool, prompts, 2).values()} == {2}
        assert_engine_holds(rollout.engine, actor_model)

        events = rollout.engine.events
        # Two chunks, sleep, wake, then the early chunk and two more: never a generation while asleep.
        assert events == ["generate", "generated"] * 2 + ["sleep", "wake"] + ["generate", "generated"] * 3
        assert rollout.server.sleeps == 1
    finally:
        pool.close()
        rollout.stop()


def test_sleep_waits_for_the_chunk_being_generated(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    pool = RolloutPool(rollout.context.identity.endpoints["rollout"], publisher, "actor-a")
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")] * 16
    try:
        pool.sync(1, model)
        pool.submit(prompts, Sampling(n=8, max_tokens=12).to_wire(), 1, meta="long")
        pool.sleep()
        # Whenever the chunk started, it ended before the engine slept: sleep answered after it.
        events = rollout.engine.events
        assert events[-1] == "sleep" and "generate" not in events[events.index("generated") + 1 :]
        assert events.count("generate") == events.count("generated") == 1 or events == ["sleep"]
        pool.wake()
        results = []
        while not results:
            results = pool.poll()
        assert [r.chunk.meta for r in results] == ["long"]
    finally:
        pool.close()
        rollout.stop()


def wait_until_generating(engine: RecordingEngine) -> None:
    for _ in range(1000):
        if "generate" in engine.events:
            return
        time.sleep(0.01)
    raise AssertionError("the chunk never started")


def rollout_status(rollout: CollocatedRollout) -> dict:
    """The rollout's answer to a status request, asked on a connection of its own (no retry: one chance)."""
    client = RequestClient(rollout.endpoint, timeout=5.0, retries=0)
    try:
        return client.call("status")
    finally:
        client.close()


def test_a_sleep_asked_during_a_long_chunk_leaves_the_rollout_answering_and_the_actor_waits(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.gate = threading.Event()
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    pool = RolloutPool(rollout.context.identity.endpoints["rollout"], publisher, "actor-a")
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")]
    sleeping: list[float] = []
    actor = threading.Thread(target=lambda: sleeping.append(pool.sleep()))
    try:
        pool.sync(1, model)
        pool.submit(prompts, SAMPLING, 1, meta="leftover")
        wait_until_generating(rollout.engine)
        actor.start()  # the actor asks the rollout to sleep before it trains, the chunk still running
        for _ in range(3):  # the rollout keeps answering while its chunk runs
            assert rollout_status(rollout)["asleep"] is False
        assert actor.is_alive() and not sleeping  # and the actor does not train beside the awake engine
        rollout.engine.gate.set()  # the chunk ends: the engine sleeps, then the actor goes on
        actor.join(30)
        assert not actor.is_alive() and len(sleeping) == 1
        assert rollout.engine.events == ["generate", "generated", "sleep"]
        assert rollout_status(rollout)["asleep"] is True
        pool.wake()
        assert rollout_status(rollout)["asleep"] is False
        results = []
        while not results:
            results = pool.poll()
        assert [r.chunk.meta for r in results] == ["leftover"]
    finally:
        rollout.engine.gate.set()
        actor.join(30)
        pool.close()
        rollout.stop()


def test_a_rollout_that_does_not_sleep_in_time_fails_the_actor_naming_it(tmp_path, policy, monkeypatch):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.gate = threading.Event()
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    pool = RolloutPool(rollout.context.identity.endpoints["rollout"], publisher, "actor-a")
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")]
    monkeypatch.setattr(pool_module, "SLEEP_TIMEOUT_S", 1.0)
    try:
        pool.sync(1, model)
        pool.submit(prompts, SAMPLING, 1, meta="stuck")
        wait_until_generating(rollout.engine)
        with pytest.raises(RolloutAwake, match=r"rollout 0 did not free its GPU memory within 1s: .*still generating"):
            pool.sleep()
        assert "sleep" not in rollout.engine.events
        # The rollout itself is unharmed: its chunk ends and it sleeps as asked.
        rollout.engine.gate.set()
        pool.sleep()
        assert rollout.engine.events == ["generate", "generated", "sleep"]
    finally:
        rollout.engine.gate.set()
        pool.close()
        rollout.stop()


def test_a_slow_wake_leaves_the_rollout_answering_and_the_actor_waits_for_it(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.wake_gate = threading.Event()
    pool = RolloutPool(
        rollout.context.identity.endpoints["rollout"], IpcWeightPublisher("actor-a", root=tmp_path), "actor-a"
    )
    waking: list[float] = []
    actor = threading.Thread(target=lambda: waking.append(pool.wake()))
    try:
        pool.sync(1, model)
        pool.sleep()
        actor.start()  # the actor wakes the rollout before it sends weights and work; the engine takes its time
        for _ in range(3):  # the rollout keeps answering while its engine wakes
            assert rollout_status(rollout)["asleep"] is True
        assert actor.is_alive() and not waking  # and the actor sends nothing to a still sleeping engine
        rollout.engine.wake_gate.set()
        actor.join(30)
        assert not actor.is_alive() and len(waking) == 1
        assert rollout.engine.events == ["sleep", "wake"]
        assert {r.version for r in run_step(pool, [tokenizer("3+4=")["input_ids"]], 1).values()} == {1}
    finally:
        rollout.engine.wake_gate.set()
        actor.join(30)
        pool.close()
        rollout.stop()


def test_a_rollout_that_does_not_wake_in_time_fails_the_actor_naming_it(tmp_path, policy, monkeypatch):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.wake_gate = threading.Event()
    pool = RolloutPool(
        rollout.context.identity.endpoints["rollout"], IpcWeightPublisher("actor-a", root=tmp_path), "actor-a"
    )
    monkeypatch.setattr(pool_module, "SLEEP_TIMEOUT_S", 1.0)
    try:
        pool.sync(1, model)
        pool.sleep()
        with pytest.raises(RolloutAsleep, match=r"rollout 0 did not take its GPU memory back within 1s"):
            pool.wake()
    finally:
        rollout.engine.wake_gate.set()
        pool.close()
        rollout.stop()


@pytest.mark.timeout(120)
def test_a_rollout_gone_while_asleep_is_left_out_without_waiting_for_a_reply_timeout(tmp_path, policy, monkeypatch):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    pool = RolloutPool(
        rollout.context.identity.endpoints["rollout"], IpcWeightPublisher("actor-a", root=tmp_path), "actor-a"
    )
    # A reply timeout long enough to fail this test by its own limit if `wake` waited for it (it once did, 60 s,
    # for a collocated rollout that died while the actor trained); `wake` needs no answer from a gone rollout.
    monkeypatch.setattr(pool_module, "SYNC_REPLY_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(pool_module, "TURN_REPLY_TIMEOUT_S", 1.0)
    try:
        pool.sync(1, model)
        pool.sleep()
        rollout.stop()  # it dies while the actor trains
        pool.wake()
        assert pool.links[0].version == -1  # lost: the chunks go to it again only once it is back and synced
    finally:
        pool.close()
        rollout.stop()


def test_a_new_actor_finds_the_rollout_its_predecessor_put_to_sleep_awake_for_its_work(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    endpoints = rollout.context.identity.endpoints["rollout"]
    first = RolloutPool(endpoints, IpcWeightPublisher("actor-a", root=tmp_path / "a"), "actor-a")
    second = None
    try:
        first.sync(1, model)
        first.sleep()  # then the actor dies while it trains (`rljob run` restarts the actor, not its rollout)
        first.close()
        second = RolloutPool(endpoints, IpcWeightPublisher("actor-b", root=tmp_path / "b"), "actor-b")
        second.sync(1, model)  # a new actor syncs and generates first: it wakes the rollout only after training
        assert {r.version for r in run_step(second, [tokenizer("3+4=")["input_ids"]], 1).values()} == {1}
        assert rollout.engine.events == ["sleep", "wake", "generate", "generated"]
    finally:
        if second is not None:
            second.close()
        rollout.stop()


def test_a_late_answer_to_sleep_is_asked_again_not_taken_for_asleep(tmp_path, policy, monkeypatch):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.gate = threading.Event()
    pool = RolloutPool(
        rollout.context.identity.endpoints["rollout"], IpcWeightPublisher("actor-a", root=tmp_path), "actor-a"
    )
    # Every "not yet" answer comes after the rollout's SLEEP_WAIT_S, too late for this reply timeout: a late answer
    # from a rollout that still answers its status must be asked again, never counted as asleep.
    monkeypatch.setattr(pool_module, "TURN_REPLY_TIMEOUT_S", 0.05)
    sleeping: list[float] = []
    actor = threading.Thread(target=lambda: sleeping.append(pool.sleep()))
    try:
        pool.sync(1, model)
        pool.submit([tokenizer("3+4=")["input_ids"]], SAMPLING, 1, meta="leftover")
        wait_until_generating(rollout.engine)
        actor.start()
        for _ in range(3):
            assert rollout_status(rollout)["asleep"] is False
        assert actor.is_alive() and not sleeping
        rollout.engine.gate.set()
        actor.join(30)
        assert not actor.is_alive() and len(sleeping) == 1
        assert rollout.engine.events == ["generate", "generated", "sleep"]
    finally:
        rollout.engine.gate.set()
        actor.join(30)
        pool.close()
        rollout.stop()


def test_a_sleep_asked_while_the_engine_wakes_is_not_answered_asleep(tmp_path, policy):
    model, tokenizer = policy
    rollout = start_collocated_rollout(model, tokenizer)
    rollout.engine.wake_gate = threading.Event()
    pool = RolloutPool(
        rollout.context.identity.endpoints["rollout"], IpcWeightPublisher("actor-a", root=tmp_path), "actor-a"
    )
    actor = threading.Thread(target=pool.wake)
    client = RequestClient(rollout.endpoint, timeout=5.0, retries=0)
    try:
        pool.sync(1, model)
        pool.sleep()
        actor.start()  # the engine is waking (held by the gate): its memory is not free, whatever it was before
        for _ in range(1000):
            if rollout.server.turning:
                break
            time.sleep(0.01)
        assert rollout.server.turning
        assert client.call("sleep", {"actor_tag": "actor-a"})["asleep"] is False
    finally:
        rollout.engine.wake_gate.set()
        actor.join(30)
        client.close()
        pool.close()
        rollout.stop()
