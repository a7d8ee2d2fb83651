"""A collocated rollout (`roles.rollout.collocated`): weights by ipc, sleep while the actor trains, wake before work.

The rollout is the rollout role's real `GenerationServer` on a tiny HF model, served over zmq on threads; the actor
side is actor rank 0's `RolloutPool` with the ipc publisher, whose CPU handles are real shared memory (the CUDA
ones: tests/gpu/test_cuda_ipc.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from rljob.api import validate_job
from rljob.launch.local import free_ports
from rljob.runtime.identity import local_identities, ports_needed
from rljob.runtime.llm.engine import Completion, HFEngine, Sampling, WeightSyncSettings
from rljob.runtime.llm.pool import RolloutPool
from rljob.runtime.weight_ipc import IpcWeightPublisher
from tests.runtime.llm.test_engine import CPU
from tests.runtime.llm.test_membership import RolloutReplica, run_step, tiny_policy

EXAMPLE = Path(__file__).parents[3] / "examples" / "grpo-tiny-arithmetic.yaml"


def collocated_job():
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"]["roles"]["rollout"]["collocated"] = True
    data["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    return validate_job(data)


class RecordingEngine(HFEngine):
    """The hf engine, writing down when it generates, sleeps and wakes (the order is what is tested)."""

    events: list[str]

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self.events.append("generate")
        try:
            return super().generate(prompts, sampling)
        finally:
            self.events.append("generated")

    def sleep(self) -> None:
        super().sleep()
        self.events.append("sleep")

    def wake(self) -> None:
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
