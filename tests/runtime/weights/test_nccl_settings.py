"""What both ends of an NCCL weight sync agree on before any communicator exists (issue 33, items 11 and 12): one
NCCL_CUMEM_ENABLE on the actor and in every rollout (and so in vLLM's workers), and a communicator created non-
blocking so a member that dies between the rendezvous and the init costs a timeout, not a hang. ProcessGroupNCCL
(absent from CPU builds of torch) is replaced by a recorder of what it is given; tests/gpu runs the real one."""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from rljob.runtime.weights import sync
from rljob.runtime.weights.sync import GROUP_TIMEOUT, align_nccl_environment
from tests.runtime.weights.test_sync import free_port
from tests.runtime.wire.test_ranks import actor_replica


def test_both_ends_start_with_the_same_cumem_setting_and_a_bounded_nonblocking_init():
    environ: dict[str, str] = {}
    align_nccl_environment(environ)
    assert environ == {
        "NCCL_CUMEM_ENABLE": "0",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(int(GROUP_TIMEOUT.total_seconds())),
    }
    chosen = {"NCCL_CUMEM_ENABLE": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}
    align_nccl_environment(chosen)  # the user's choice stands, on both ends alike
    assert chosen == {"NCCL_CUMEM_ENABLE": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}


def test_every_role_process_aligns_the_setting_before_it_starts_anything(monkeypatch):
    import typer

    from rljob.cli import role as role_cli
    from rljob.runtime.wire import ranks

    identity = actor_replica(0, 2)
    for key, value in identity.to_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    seen: list[str | None] = []
    monkeypatch.setattr(ranks, "run_rank_group", lambda identity: seen.append(os.environ.get("NCCL_CUMEM_ENABLE")) or 0)
    with pytest.raises(typer.Exit):
        role_cli.role("actor")
    assert seen == ["0"]  # the ranks (and a collocated rollout, started before them) inherit it


class RecordedNCCL:
    """What `_nccl_group` hands ProcessGroupNCCL, and the environment it is constructed in."""

    made: list[RecordedNCCL] = []

    class Options:
        def __init__(self) -> None:
            self._timeout: datetime.timedelta | None = None
            self.is_high_priority_stream = True
            self.config = type("NCCLConfig", (), {"blocking": -2147483648})()  # NCCL_CONFIG_UNDEF_INT

    def __init__(self, store, rank: int, world: int, options) -> None:
        self.options = options
        self.env = {k: os.environ.get(k) for k in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_NONBLOCKING_TIMEOUT")}
        RecordedNCCL.made.append(self)

    def _set_sequence_number_for_group(self) -> None:
        pass

    def eager_connect_single_device(self, device) -> None:
        self.connected = device


def test_the_weight_sync_communicator_is_created_nonblocking_under_the_group_timeout(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordedNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    port = free_port()
    store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    RecordedNCCL.made.clear()
    sync._nccl_group(PrefixStore("g/", store), 0, 1, torch.device("cuda", 0))
    [group] = RecordedNCCL.made
    assert group.options.config.blocking == 0
    assert group.env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}
    assert group.options._timeout == GROUP_TIMEOUT


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = {k: os.environ.get(k) for k in ("NCCL_CUMEM_ENABLE", "TORCH_NCCL_NONBLOCKING_TIMEOUT")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
