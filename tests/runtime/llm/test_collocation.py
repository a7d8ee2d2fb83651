"""A collocated rollout (`roles.rollout.collocated`): weights by ipc, sleep while the actor trains, wake before work.

The rollout is the rollout role's real `GenerationServer` on a tiny HF model, served over zmq on threads; the actor
side is actor rank 0's `RolloutPool` with the ipc publisher, whose CPU handles are real shared memory (the CUDA
ones: tests/gpu/test_cuda_ipc.py).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from rljob.api import validate_job
from rljob.launch.local import free_ports
from rljob.runtime.llm.engines.base import Completion, Sampling, WeightSyncSettings
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.replicas import pool as pool_module
from rljob.runtime.llm.replicas.pool import RolloutAsleep, RolloutAwake, RolloutPool
from rljob.runtime.weights.ipc import IpcWeightPublisher
from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.transport import RequestClient
from tests.runtime.llm.engines.test_engine import CPU
from tests.runtime.llm.replicas.test_membership import RolloutReplica, run_step, tiny_policy

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


def ipc_pool(rollout: CollocatedRollout, root: Path, actor_tag: str = "actor-a") -> RolloutPool:
    """Actor rank 0's pool of this one rollout, weights by ipc (its shared memory under `root`)."""
    publisher = IpcWeightPublisher(actor_tag, root=root)
    return RolloutPool(rollout.context.identity.endpoints["rollout"], publisher, actor_tag)


class Pair:
    """A collocated rollout and actor rank 0's pool of it; the actor's calls that wait run in threads of their own."""

    def __init__(self, rollout: CollocatedRollout, pool: RolloutPool) -> None:
        self.rollout, self.pool, self.engine = rollout, pool, rollout.engine
        self.threads: list[threading.Thread] = []

    def in_actor_thread(self, call: Callable[[], float]) -> tuple[threading.Thread, list[float]]:
        """Start `call` (the actor waiting on the rollout) in a thread; what it returns lands in the list."""
        returned: list[float] = []
        thread = threading.Thread(target=lambda: returned.append(call()))
        thread.start()
        self.threads.append(thread)
        return thread, returned

    def assert_answering_while_the_actor_waits(self, actor: threading.Thread, returned: list, asleep: bool) -> None:
        """The rollout answers `status` (saying `asleep`) each time it is asked, and the actor's thread waits."""
        for _ in range(3):
            assert rollout_status(self.rollout)["asleep"] is asleep
        assert actor.is_alive() and not returned

    def close(self) -> None:
        for gate in (self.engine.gate, self.engine.wake_gate):
            if gate is not None:
                gate.set()
        for thread in self.threads:
            thread.join(30)
        self.pool.close()
        self.rollout.stop()


@pytest.fixture
def pair(tmp_path, policy):
    rollout = start_collocated_rollout(*policy)
    pair = Pair(rollout, ipc_pool(rollout, tmp_path))
    yield pair
    pair.close()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(what)


def rollout_status(rollout: CollocatedRollout) -> dict:
    """The rollout's answer to a status request, asked on a connection of its own (no retry: one chance)."""
    client = RequestClient(rollout.endpoint, timeout=5.0, retries=0)
    try:
        return client.call("status")
    finally:
        client.close()


def collect(pool: RolloutPool) -> list:
    results = []
    while not results:
        results = pool.poll()
    return results


def assert_engine_holds(engine: HFEngine, actor: torch.nn.Module) -> None:
    engine.swap_in()
    for mine, theirs in zip(engine.model.state_dict().values(), actor.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_actor_s_turns_sleep_train_wake_sync_generate_reach_the_rollout_in_order(pair, policy):
    model, tokenizer = policy
    pool = pair.pool
    actor_model = copy.deepcopy(model)
    with torch.no_grad():  # the actor's weights differ from the rollout's starting ones until a sync
        for p in actor_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")]
    pool.sync(1, actor_model)  # version 1 through shared memory, loaded before `sync` returns
    assert pool.links[0].version == 1
    assert {r.version for r in run_step(pool, prompts, 2).values()} == {1}

    pool.sleep()  # the actor is about to train
    assert pair.rollout.server.asleep
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
    assert [r.chunk.meta for r in collect(pool)] == ["early"]
    assert {r.version for r in run_step(pool, prompts, 2).values()} == {2}
    assert_engine_holds(pair.engine, actor_model)

    # Two chunks, sleep, wake, then the early chunk and two more: never a generation while asleep.
    assert pair.engine.events == ["generate", "generated"] * 2 + ["sleep", "wake"] + ["generate", "generated"] * 3
    assert pair.rollout.server.sleeps == 1


def test_sleep_waits_for_the_chunk_being_generated(pair, policy):
    model, tokenizer = policy
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")] * 16
    pair.pool.sync(1, model)
    pair.pool.submit(prompts, Sampling(n=8, max_tokens=12).to_wire(), 1, meta="long")
    pair.pool.sleep()
    # Whenever the chunk started, it ended before the engine slept: sleep answered after it.
    events = pair.engine.events
    assert events[-1] == "sleep" and "generate" not in events[events.index("generated") + 1 :]
    assert events.count("generate") == events.count("generated") == 1 or events == ["sleep"]
    pair.pool.wake()
    assert [r.chunk.meta for r in collect(pair.pool)] == ["long"]


def start_a_held_chunk(pair: Pair, model, tokenizer, meta: str) -> None:
    """Version 1 synced, then a chunk that runs until the test opens the engine's gate."""
    pair.engine.gate = threading.Event()
    pair.pool.sync(1, model)
    pair.pool.submit([tokenizer(text)["input_ids"] for text in ("3+4=", "1+2=")], SAMPLING, 1, meta=meta)
    wait_until(lambda: "generate" in pair.engine.events, "the chunk never started")


def test_a_sleep_asked_during_a_long_chunk_leaves_the_rollout_answering_and_the_actor_waits(pair, policy):
    start_a_held_chunk(pair, *policy, meta="leftover")
    actor, slept = pair.in_actor_thread(pair.pool.sleep)  # the actor asks for sleep before it trains
    # The rollout keeps answering while its chunk runs, and the actor does not train beside the awake engine.
    pair.assert_answering_while_the_actor_waits(actor, slept, asleep=False)
    pair.engine.gate.set()  # the chunk ends: the engine sleeps, then the actor goes on
    actor.join(30)
    assert not actor.is_alive() and len(slept) == 1
    assert pair.engine.events == ["generate", "generated", "sleep"]
    assert rollout_status(pair.rollout)["asleep"] is True
    pair.pool.wake()
    assert rollout_status(pair.rollout)["asleep"] is False
    assert [r.chunk.meta for r in collect(pair.pool)] == ["leftover"]


def test_a_late_answer_to_sleep_is_asked_again_not_taken_for_asleep(pair, policy, monkeypatch):
    start_a_held_chunk(pair, *policy, meta="leftover")
    # Every "not yet" answer comes after the rollout's SLEEP_WAIT_S, too late for this reply timeout: a late answer
    # from a rollout that still answers its status must be asked again, never counted as asleep.
    monkeypatch.setattr(pool_module, "TURN_REPLY_TIMEOUT_S", 0.05)
    actor, slept = pair.in_actor_thread(pair.pool.sleep)
    pair.assert_answering_while_the_actor_waits(actor, slept, asleep=False)
    pair.engine.gate.set()
    actor.join(30)
    assert not actor.is_alive() and len(slept) == 1
    assert pair.engine.events == ["generate", "generated", "sleep"]


def test_a_rollout_that_does_not_sleep_in_time_fails_the_actor_naming_it(pair, policy, monkeypatch):
    start_a_held_chunk(pair, *policy, meta="stuck")
    monkeypatch.setattr(pool_module, "SLEEP_TIMEOUT_S", 1.0)
    with pytest.raises(RolloutAwake, match=r"rollout 0 did not free its GPU memory within 1s: .*still generating"):
        pair.pool.sleep()
    assert "sleep" not in pair.engine.events
    # The rollout itself is unharmed: its chunk ends and it sleeps as asked.
    pair.engine.gate.set()
    pair.pool.sleep()
    assert pair.engine.events == ["generate", "generated", "sleep"]


def put_to_sleep_with_a_held_wake(pair: Pair, model) -> None:
    """Version 1 synced and the engine asleep; its next wake returns only once the test opens the wake gate."""
    pair.engine.wake_gate = threading.Event()
    pair.pool.sync(1, model)
    pair.pool.sleep()


def test_a_slow_wake_leaves_the_rollout_answering_and_the_actor_waits_for_it(pair, policy):
    model, tokenizer = policy
    put_to_sleep_with_a_held_wake(pair, model)
    actor, woke = pair.in_actor_thread(pair.pool.wake)  # before weights and work; the engine takes its time
    # The rollout keeps answering while its engine wakes, and the actor sends nothing to the sleeping engine.
    pair.assert_answering_while_the_actor_waits(actor, woke, asleep=True)
    pair.engine.wake_gate.set()
    actor.join(30)
    assert not actor.is_alive() and len(woke) == 1
    assert pair.engine.events == ["sleep", "wake"]
    assert {r.version for r in run_step(pair.pool, [tokenizer("3+4=")["input_ids"]], 1).values()} == {1}


def test_a_rollout_that_does_not_wake_in_time_fails_the_actor_naming_it(pair, policy, monkeypatch):
    put_to_sleep_with_a_held_wake(pair, policy[0])
    monkeypatch.setattr(pool_module, "SLEEP_TIMEOUT_S", 1.0)
    with pytest.raises(RolloutAsleep, match=r"rollout 0 did not take its GPU memory back within 1s"):
        pair.pool.wake()


def test_a_sleep_asked_while_the_engine_wakes_is_not_answered_asleep(pair, policy):
    put_to_sleep_with_a_held_wake(pair, policy[0])
    pair.in_actor_thread(pair.pool.wake)  # the engine is waking (held): its memory is not free, whatever it was
    wait_until(lambda: pair.rollout.server.turning, "the engine never started waking")
    client = RequestClient(pair.rollout.endpoint, timeout=5.0, retries=0)
    try:
        assert client.call("sleep", {"actor_tag": "actor-a"})["asleep"] is False
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_rollout_gone_while_asleep_is_left_out_without_waiting_for_a_reply_timeout(pair, policy, monkeypatch):
    # A reply timeout long enough to fail this test by its own limit if `wake` waited for it (it once did, 60 s,
    # for a collocated rollout that died while the actor trained); `wake` needs no answer from a gone rollout.
    monkeypatch.setattr(pool_module, "SYNC_REPLY_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(pool_module, "TURN_REPLY_TIMEOUT_S", 1.0)
    pair.pool.sync(1, policy[0])
    pair.pool.sleep()
    pair.rollout.stop()  # it dies while the actor trains
    pair.pool.wake()
    assert pair.pool.links[0].version == -1  # lost: the chunks go to it again only once it is back and synced


def test_a_new_actor_finds_the_rollout_its_predecessor_put_to_sleep_awake_for_its_work(pair, policy, tmp_path):
    model, tokenizer = policy
    pair.pool.sync(1, model)
    pair.pool.sleep()  # then the actor dies while it trains (`rljob run` restarts the actor, not its rollout)
    pair.pool.close()
    pair.pool = ipc_pool(pair.rollout, tmp_path / "next", "actor-b")
    pair.pool.sync(1, model)  # a new actor syncs and generates first: it wakes the rollout only after training
    assert {r.version for r in run_step(pair.pool, [tokenizer("3+4=")["input_ids"]], 1).values()} == {1}
    assert pair.engine.events == ["sleep", "wake", "generate", "generated"]


@pytest.mark.parametrize(
    ("engine", "field"), [("vllm", "spec.rollout.vllm.gpuMemoryUtilization"), ("hf", "spec.roles.actor.gpusPerReplica")]
)
def test_a_collocated_actor_whose_model_does_not_fit_beside_the_engine_names_the_field(monkeypatch, engine, field):
    from rljob.runtime.llm.actor import collocated_oom

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    message = collocated_oom(engine, torch.device("cuda", 0))
    assert message.startswith(f"{field}: the actor's model did not fit on the GPU beside the collocated rollout")
    assert "3.0 of 80.0 GiB of cuda:0 was free" in message


def test_running_out_of_gpu_memory_beside_the_rollout_is_a_setting_to_change_not_a_crash(monkeypatch):
    from rljob.runtime.llm.actor import fits_beside_rollout
    from rljob.runtime.wire.context import FatalConfigError

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    gpu = torch.device("cuda", 0)
    field = r"spec\.rollout\.vllm\.gpuMemoryUtilization: the actor's model"
    with pytest.raises(FatalConfigError, match=field), fits_beside_rollout(True, "vllm", gpu):
        raise torch.OutOfMemoryError("CUDA out of memory")
    # No rollout beside it: nothing to change there.
    with pytest.raises(torch.OutOfMemoryError), fits_beside_rollout(False, "vllm", gpu):
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(ValueError, match="not memory"), fits_beside_rollout(True, "vllm", gpu):
        raise ValueError("not memory")
    with fits_beside_rollout(True, "vllm", gpu):
        pass
