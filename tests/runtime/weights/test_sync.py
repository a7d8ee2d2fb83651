"""Weight sync over real torch.distributed (gloo) groups: every rollout's copy equals the actor's."""

from __future__ import annotations

import datetime
import socket
import threading

import gymnasium
import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from rljob.runtime.gym.models import MLPActorCritic
from rljob.runtime.weights import sync as weight_sync
from rljob.runtime.weights.sync import (
    AcceptDeadlines,
    PackBuffer,
    SyncAborted,
    SyncRefused,
    WeightPublisher,
    WeightSubscriber,
    make_group,
    rendezvous,
    state_tensors,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for mine, theirs in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)


def sync_round(
    publisher: WeightPublisher,
    actor: torch.nn.Module,
    version: int,
    rollouts: dict[int, tuple[str, WeightSubscriber, torch.nn.Module]],
) -> dict[int, BaseException | None]:
    """One round to `rollouts` (replica -> incarnation, subscriber, model); each replica's error, or None."""
    keys = publisher.plan([(replica, tag) for replica, (tag, _, _) in rollouts.items()], version, actor)
    errors: dict[int, BaseException | None] = {}

    def receive(replica: int) -> None:
        _, subscriber, model = rollouts[replica]
        try:
            subscriber.receive(keys[replica], version, "actor-a", model)
            errors[replica] = None
        except BaseException as exc:
            errors[replica] = exc

    threads = [threading.Thread(target=receive, args=(replica,)) for replica in rollouts]
    for thread in threads:
        thread.start()
    publisher.publish(version, actor)
    for thread in threads:
        thread.join(timeout=30)
    return errors


def first_round_to_one_rollout() -> tuple[torch.nn.Module, int, WeightPublisher, dict]:
    """An actor, its publisher on a fresh port and one rollout, after a first round that reached the rollout."""
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    rollouts = {0: ("rollout-0", WeightSubscriber("127.0.0.1", port, 1), MLPActorCritic(4, space))}
    perturb(actor)
    assert sync_round(publisher, actor, 1, rollouts) == {0: None}
    return actor, port, publisher, rollouts


def test_one_broadcast_reaches_every_rollout_and_the_group_is_kept_while_members_stay():
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    rollouts = {i: (f"rollout-{i}", WeightSubscriber("127.0.0.1", port, 1), MLPActorCritic(4, space)) for i in range(3)}
    keys = []
    for version in (1, 2):
        perturb(actor)
        keys.append(publisher.plan([(i, tag) for i, (tag, _, _) in rollouts.items()], version, actor))
        errors = sync_round(publisher, actor, version, rollouts)
        assert errors == {0: None, 1: None, 2: None}
        for _, _, model in rollouts.values():
            assert_same_weights(actor, model)
    group_of = {key.rsplit("|", 3)[0] for plan in keys for key in plan.values()}
    assert len(group_of) == 1  # same members, same group: no re-forming between versions
    publisher.close()


def test_a_pack_buffer_lets_its_device_buffers_go_and_keeps_the_host_ones():
    """The end of a round: off the host, a buffer is memory the update or the engine needs until the next round
    ('meta' stands for a GPU here: a device whose buffers cost no memory on this machine)."""
    pack = PackBuffer()
    host = pack.take(1000, torch.float32)
    pack.take(10, torch.bfloat16)
    pack.take(500, torch.float32, torch.device("meta"))
    assert pack.held() == {"cpu": 4000 + 20, "meta": 2000}
    pack.release_device()
    assert pack.held() == {"cpu": 4020}
    assert pack.take(800, torch.float32).data_ptr() == host.data_ptr()  # the host buffer is reused as it was


def test_a_round_on_the_host_keeps_its_pack_buffers_on_both_sides_for_the_next():
    actor, _, publisher, rollouts = first_round_to_one_rollout()
    _, subscriber, _ = rollouts[0]
    sent, received = publisher._pack.held(), subscriber._pack.held()
    assert set(sent) == set(received) == {"cpu"} and sent["cpu"] > 0 and received["cpu"] > 0
    perturb(actor)
    assert sync_round(publisher, actor, 2, rollouts) == {0: None}
    assert publisher._pack.held() == sent and subscriber._pack.held() == received
    publisher.close()


def test_a_joined_or_restarted_rollout_makes_the_next_round_form_a_new_group():
    actor, port, publisher, rollouts = first_round_to_one_rollout()
    space = gymnasium.make("CartPole-v1").action_space
    first_group = publisher.plan([(0, "rollout-0")], 2, actor)[0].rsplit("|", 3)[0]

    rollouts[1] = ("rollout-1", WeightSubscriber("127.0.0.1", port, 1), MLPActorCritic(4, space))  # joins
    perturb(actor)
    assert sync_round(publisher, actor, 2, rollouts) == {0: None, 1: None}
    publisher.forget(0)  # replica 0 restarted: a new process, a new subscriber
    rollouts[0] = ("rollout-0b", WeightSubscriber("127.0.0.1", port, 1), MLPActorCritic(4, space))
    perturb(actor)
    assert sync_round(publisher, actor, 3, rollouts) == {0: None, 1: None}
    for _, _, model in rollouts.values():
        assert_same_weights(actor, model)
    last_group = publisher.plan([(0, "rollout-0b"), (1, "rollout-1")], 4, actor)[0].rsplit("|", 3)[0]
    assert last_group != first_group
    publisher.close()


@pytest.fixture
def short_first_accept(monkeypatch):
    """A member never seen is given 2 s here (20 s in a job), so the absent-member tests stay short."""
    monkeypatch.setattr(weight_sync, "ACCEPT_FIRST_S", 2.0)


def test_a_rollout_that_never_accepts_aborts_the_round_for_the_others_who_stop_waiting_at_once(short_first_accept):
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    alive = WeightSubscriber("127.0.0.1", port, 1)
    model = MLPActorCritic(4, space)
    keys = publisher.plan([(0, "rollout-0"), (1, "gone")], 1, actor)
    outcome: list[BaseException] = []

    def receive() -> None:
        try:
            alive.receive(keys[0], 1, "actor-a", model)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    with pytest.raises(SyncRefused, match=r"rollout\(s\) \[1\] did not accept weights version 1") as refused:
        publisher.publish(1, actor)
    assert refused.value.replicas == {1}
    thread.join(timeout=10)  # well under the group timeout: the abort reached it
    assert not thread.is_alive() and isinstance(outcome[0], SyncAborted)

    perturb(actor)  # the retry without the absent replica
    assert sync_round(publisher, actor, 1, {0: ("rollout-0", alive, model)}) == {0: None}
    assert_same_weights(actor, model)
    publisher.close()


def test_a_member_with_several_ranks_receives_on_each_of_them():
    """A vLLM rollout with tensor-parallel workers: every worker joins at its rank and gets the full tensors."""
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1, ranks_per_replica=2)
    perturb(actor)
    keys = publisher.plan([(0, "rollout-0"), (1, "rollout-1")], 1, actor)
    workers = [(replica, tp_rank, MLPActorCritic(4, space)) for replica in (0, 1) for tp_rank in (0, 1)]

    def receive(replica: int, tp_rank: int, model: torch.nn.Module) -> None:
        subscriber = WeightSubscriber("127.0.0.1", port, 1)
        if tp_rank == 0:
            subscriber.accept(keys[replica], 1, "actor-a")  # the rollout accepts once for its workers
        subscriber.receive_tensors(keys[replica], "actor-a", state_tensors(model), rank_offset=tp_rank)

    threads = [threading.Thread(target=receive, args=worker) for worker in workers]
    for thread in threads:
        thread.start()
    publisher.publish(1, actor)
    for thread in threads:
        thread.join(timeout=30)
    for _, _, model in workers:
        assert_same_weights(actor, model)
    publisher.close()


def test_a_sync_nobody_accepts_is_refused_once_its_wait_is_over(short_first_accept):
    publisher = WeightPublisher("127.0.0.1", free_port(), "actor-a", bucket_mb=1)
    model = MLPActorCritic(4, gymnasium.make("CartPole-v1").action_space)
    publisher.plan([(0, "gone")], 3, model)
    with pytest.raises(SyncRefused, match="did not accept weights version 3"):
        publisher.publish(3, model)


def test_weight_files_are_written_whole_versioned_and_pruned(tmp_path):
    from rljob.runtime.weights.sync import FileWeightPublisher, read_weights_file, write_weights_file

    model = MLPActorCritic(4, gymnasium.make("CartPole-v1").action_space)
    write_weights_file(tmp_path, 1, "old-actor", model)
    publisher = FileWeightPublisher(tmp_path, "actor-a")
    paths = []
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        plan = publisher.plan([(0, "rollout-1"), (1, "rollout-2")], version, model)
        path = plan[0]
        assert plan[1] == path  # one file per version, any replica
        paths.append(path)
        loaded = read_weights_file(path)
        assert sorted(loaded) == sorted(model.state_dict())  # by name: safetensors sorts them
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded[name], tensor)
    assert paths[-1].endswith("weights-00000003-actor-a.safetensors")
    # The newest two of this actor stay (a rollout may still read the previous one); no temporary file is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "weights-00000002-actor-a.safetensors",
        "weights-00000003-actor-a.safetensors",
    ]


def test_an_hf_engine_takes_a_weight_file_in_and_swaps_it_in_between_chunks(tmp_path):
    from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec
    from rljob.runtime.llm.data.rows import arithmetic_rows
    from rljob.runtime.llm.engines.base import WeightSyncSettings, WeightUpdate
    from rljob.runtime.llm.engines.hf import HFEngine
    from rljob.runtime.llm.models.policy import load_policy
    from rljob.runtime.weights.sync import write_weights_file

    task = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=8), max_prompt_length=8, max_response_length=2)
    spec = ModelSpec(source="builtin", builtin=BuiltinNetwork(hidden_size=16, num_layers=1, num_heads=2))
    model, tokenizer = load_policy(spec, task, arithmetic_rows(8, 0), 0, torch.device("cpu"))
    trainer, _ = load_policy(spec, task, arithmetic_rows(8, 0), 0, torch.device("cpu"))
    with torch.no_grad():
        trainer.model.embed_tokens.weight.mul_(2.0)  # the tied head moves with it
    engine = HFEngine(model, tokenizer, torch.device("cpu"), WeightSyncSettings("filesystem", "", 0, 1))
    assert engine.swap_in() is None
    engine.receive_weights(WeightUpdate(5, "actor-a", str(write_weights_file(tmp_path, 5, "actor-a", trainer))))
    assert not torch.equal(model.lm_head.weight, trainer.lm_head.weight)  # staged, not live yet
    assert engine.swap_in() == 5 and engine.swap_in() is None
    for mine, theirs in zip(model.state_dict().values(), trainer.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: the nccl case needs 2 GPUs"
)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.cuda, TWO_GPUS])])
def test_big_tensors_travel_in_place_and_small_ones_packed_whatever_their_dtype_or_layout(backend):
    from torch.distributed import TCPStore

    from rljob.runtime.weights.sync import IN_PLACE_MIN_BYTES, broadcast_state, make_group

    def state(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        big = torch.randn(IN_PLACE_MIN_BYTES // 4 + 7, generator=g)
        tied = torch.randn(64, 3, generator=g)
        return [
            big,  # in place
            torch.randn(512, 1024, generator=g).t(),  # big but not contiguous: packed
            torch.randn(5, generator=g),  # small float32
            torch.randint(0, 100, (9,), generator=g),  # small int64: its own pack
            tied,
            tied,  # the same tensor twice, as a tied head is in a state dict
            torch.randn(3, generator=g).to(torch.bfloat16),
        ]

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    # Under NCCL each rank's tensors are on a GPU of its own; the buffers follow them there.
    cpu, gpus = torch.device("cpu"), (torch.device("cuda", 0), torch.device("cuda", 1))
    here, there = (cpu, cpu) if backend == "gloo" else gpus
    sent, received = [t.to(here) for t in state(1)], [t.to(there) for t in state(2)]
    assert not torch.equal(sent[0].cpu(), received[0].cpu())
    # The receiver's own store client, as in its own process: one client is not shared between threads.
    receiving_store = TCPStore("127.0.0.1", port, is_master=False)
    receiver = threading.Thread(
        target=lambda: broadcast_state(
            make_group(receiving_store, "g", 1, 2, backend, there), received, bucket_bytes=3 * IN_PLACE_MIN_BYTES
        )
    )
    receiver.start()
    broadcast_state(make_group(store, "g", 0, 2, backend, here), sent, bucket_bytes=3 * IN_PLACE_MIN_BYTES)
    receiver.join(timeout=30)
    for mine, theirs in zip(sent, received, strict=True):
        assert theirs.device == there and mine.dtype == theirs.dtype and torch.equal(mine.cpu(), theirs.cpu())


def test_the_sync_group_uses_the_interface_gloo_socket_ifname_names(monkeypatch):
    """On a multi-NIC node users point gloo at one interface; the sync group honours it like torch's groups."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    actor, _, publisher, rollouts = first_round_to_one_rollout()
    assert_same_weights(actor, rollouts[0][2])
    publisher.close()

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-nic0")
    publisher = WeightPublisher("127.0.0.1", free_port(), "actor-a", bucket_mb=1)
    with pytest.raises(RuntimeError, match="no-such-nic0"):
        make_group(publisher.store, "g", 0, 1)
    publisher.close()


def test_accept_waits_grow_with_each_miss_up_to_a_cap_and_a_member_that_accepted_is_known():
    deadlines = AcceptDeadlines()
    newcomer, restarted = (0, "rollout-a"), (0, "rollout-b")
    assert deadlines.seconds(newcomer) == weight_sync.ACCEPT_FIRST_S
    waits = []
    for _ in range(6):
        deadlines.missed(newcomer)
        waits.append(deadlines.seconds(newcomer))
    assert waits == [40.0, 80.0, 160.0, 160.0, 160.0, 160.0]  # doubling, capped at ACCEPT_MAX_S
    deadlines.accepted(newcomer)
    assert deadlines.seconds(newcomer) == weight_sync.ACCEPT_KNOWN_S
    assert deadlines.seconds(restarted) == weight_sync.ACCEPT_FIRST_S  # a new incarnation connects anew


def test_a_member_whose_first_connection_is_slow_still_gets_the_round():
    """Its store connection took longer than a known member's wait (a reverse-DNS lookup of 10 s in a cluster
    with a silent DNS): a member never seen is waited for, and the round completes for it."""
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    perturb(actor)
    keys = publisher.plan([(0, "slow")], 1, actor)
    model = MLPActorCritic(4, space)
    late = weight_sync.ACCEPT_KNOWN_S + 1.5

    def connect_late_then_receive() -> None:
        threading.Event().wait(late)
        WeightSubscriber("127.0.0.1", port, 1).receive(keys[0], 1, "actor-a", model)

    thread = threading.Thread(target=connect_late_then_receive)
    thread.start()
    publisher.publish(1, actor)  # no SyncRefused: the newcomer's wait is ACCEPT_FIRST_S
    thread.join(timeout=30)
    assert_same_weights(actor, model)
    assert publisher.deadlines.seconds((0, "slow")) == weight_sync.ACCEPT_KNOWN_S
    publisher.close()


def test_the_round_goes_by_nccl_only_when_every_rank_holds_cuda_tensors_on_a_gpu_of_its_own():
    from rljob.runtime.weights.sync import choose_backend, joint_report

    actor, rollout_a, rollout_b = b"cuda:GPU-0", b"cuda:GPU-1", b"cuda:GPU-2"
    assert choose_backend([actor, rollout_a, rollout_b]) == "nccl"
    assert choose_backend([b"cpu", rollout_a]) == "gloo"  # a CPU-trained actor
    assert choose_backend([actor, rollout_a, b"cpu"]) == "gloo"  # one member stages on the host
    assert choose_backend([actor, b"cuda:GPU-0"]) == "gloo"  # actor and rollout share a GPU: NCCL refuses that
    assert choose_backend([actor, b"1"]) == "gloo"  # a member that says nothing of its device
    # A vLLM rollout's tensor-parallel workers: one report naming every worker's GPU, or the CPU if one is there.
    assert joint_report([b"cuda:GPU-1", b"cuda:GPU-2"]) == b"cuda:GPU-1,GPU-2"
    assert choose_backend([actor, joint_report([b"cuda:GPU-1", b"cuda:GPU-2"])]) == "nccl"
    assert choose_backend([actor, joint_report([b"cuda:GPU-1", b"cuda:GPU-0"])]) == "gloo"
    assert joint_report([b"cuda:GPU-1", b"cpu"]) == joint_report([]) == b"cpu"
    assert weight_sync.device_report([torch.device("cpu")]) == b"cpu"


def test_members_say_where_they_receive_and_the_go_key_carries_the_backend_the_actor_chose():
    """A member on a GPU (its report faked here: CUDA tensors are impossible on this machine) and one on the
    CPU, a CPU actor: the round goes by gloo, and every member learns so from the go key."""
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    perturb(actor)
    keys = publisher.plan([(0, "rollout-0"), (1, "rollout-1")], 1, actor)
    models = {replica: MLPActorCritic(4, space) for replica in keys}
    backends: dict[int, str] = {}

    def receive(replica: int, report: bytes) -> None:
        subscriber = WeightSubscriber("127.0.0.1", port, 1)
        subscriber.accept(keys[replica], 1, "actor-a", report)
        backends[replica] = subscriber.wait_go(keys[replica], "actor-a").backend
        subscriber.receive_tensors(keys[replica], "actor-a", state_tensors(models[replica]))

    threads = [
        threading.Thread(target=receive, args=(0, b"cuda:GPU-1")),
        threading.Thread(target=receive, args=(1, weight_sync.device_report([torch.device("cpu")]))),
    ]
    for thread in threads:
        thread.start()
    publisher.publish(1, actor)
    for thread in threads:
        thread.join(timeout=30)
    assert publisher.backend == "gloo" and backends == {0: "gloo", 1: "gloo"}
    for model in models.values():
        assert_same_weights(actor, model)
    publisher.close()


def test_the_go_key_names_the_backend_and_a_fresh_group_for_each_formation():
    """nccl, then gloo, then nccl again within one epoch: each group meets in store keys of its own."""
    from rljob.runtime.weights.sync import GoSignal, SyncTicket

    ticket = SyncTicket("actor-a/1", rank=1, world=2, round=7)
    go = GoSignal("nccl", 3)
    assert GoSignal.decode(go.encode()) == go
    names = {GoSignal(backend, formed).group(ticket) for backend in ("gloo", "nccl") for formed in (3, 7)}
    assert len(names) == 4 and all(name.startswith("actor-a/1/") for name in names)
    with pytest.raises(RuntimeError, match="another rljob version"):
        GoSignal.decode(b"go")  # what an actor from before this change writes


def test_ranks_meet_before_an_nccl_group_forms_and_one_that_never_comes_fails_the_round_in_time():
    """NCCL's communicator set-up waits without a timeout; the rendezvous in front of it does not."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def member(rank: int) -> None:  # each rank with its own connection, as in its own process
        rendezvous(PrefixStore("weights/g/nccl/1/pg/", TCPStore("127.0.0.1", port, is_master=False)), rank, 3)

    others = [threading.Thread(target=member, args=(rank,)) for rank in (1, 2)]
    for thread in others:
        thread.start()
    rendezvous(PrefixStore("weights/g/nccl/1/pg/", store), 0, 3)  # all three came
    for thread in others:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in others)
    late = PrefixStore("weights/g/nccl/2/pg/", store)
    with pytest.raises(RuntimeError):  # rank 2 accepted the round, then died before joining
        rendezvous(late, 0, 3, timeout=datetime.timedelta(seconds=0.3))
