"""Each actor rank selects its own GPU before anything touches CUDA (issue 33, item 1): `torch.cuda` is replaced by a
recorder here, so the calls a GPU machine would see are checked without one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rljob.runtime.wire.context import FatalConfigError
from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.ranks import join_actor_group, nccl_config_error, rank_device


@pytest.fixture
def calls(monkeypatch):
    """A machine with two GPUs: every set_device and init_process_group call, in order."""
    recorded: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: recorded.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: recorded.append(("init", (backend, kw))))
    return recorded


def test_local_rank_1_trains_on_the_second_gpu_and_makes_it_current(calls):
    device = rank_device(2, 1)
    assert device == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1))]


def test_a_rank_without_gpus_stays_on_the_cpu_and_touches_no_gpu(calls):
    assert rank_device(0, 1) == torch.device("cpu")
    assert calls == []


def test_a_local_rank_past_the_visible_gpus_is_a_configuration_error_naming_the_field(calls):
    with pytest.raises(FatalConfigError, match=r"spec.roles.actor.gpusPerReplica \(4\).*local rank 3 sees only 2"):
        rank_device(4, 3)


def test_the_nccl_group_is_bound_to_the_ranks_gpu_after_it_was_made_current(calls):
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    ports = list(range(42000, 42000 + ports_needed(replicas)))
    identity = local_identities("job", replicas, "/tmp/job.yaml", ports, actor_ranks_per_replica=2)[0].for_rank(1)
    join_actor_group(identity, torch.device("cuda", 1), 1.0)
    (first, device), (second, (backend, kwargs)) = calls
    assert (first, device) == ("set_device", torch.device("cuda", 1))
    assert second == "init" and backend == "nccl"
    assert kwargs["device_id"] == torch.device("cuda", 1)
    assert kwargs["rank"] == 1 and kwargs["world_size"] == 2


def test_a_gloo_group_on_the_cpu_is_not_bound_to_a_device(calls):
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    ports = list(range(42000, 42000 + ports_needed(replicas)))
    identity = local_identities("job", replicas, "/tmp/job.yaml", ports, actor_ranks_per_replica=2)[0].for_rank(0)
    join_actor_group(identity, torch.device("cpu"), 1.0)
    [(_, (backend, kwargs))] = calls
    assert backend == "gloo" and "device_id" not in kwargs


def test_nccl_refusing_two_ranks_on_one_gpu_names_the_fields_to_change():
    exc = RuntimeError("NCCL error: invalid usage\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 0")
    fatal = nccl_config_error(1, 2, exc)
    assert isinstance(fatal, FatalConfigError)
    assert "spec.roles.actor.replicas (1) x spec.roles.actor.gpusPerReplica (2)" in str(fatal)
    assert nccl_config_error(1, 2, RuntimeError("connection reset by peer")) is None
