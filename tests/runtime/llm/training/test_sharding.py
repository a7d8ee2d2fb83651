"""fsdp2: a sharded actor group updates like ddp and like one rank, and its checkpoints resume on other world sizes.

Every distributed case runs real ranks: one Python process each, joined in a gloo group on the CPU.
"""

from __future__ import annotations

import copy
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rljob.api.spec import AlgorithmSpec, TrainerSpec
from rljob.runtime.llm.training.learner import LLMLearner
from rljob.runtime.llm.training.packing import pack_by_tokens
from rljob.runtime.llm.training.sharding import CommandChannel, follow, load_checkpoint, save_checkpoint
from rljob.runtime.records.checkpoint import CheckpointManager

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import MAX_RESPONSE, TOKENIZER, make_groups, make_model, make_samples

ALGORITHM = AlgorithmSpec(name="grpo", kl_coef=0.0, loss_aggregation="token-mean", minibatches=2, clip_ratio_high=0.28)
SAMPLES = 24  # splits into 2 minibatches over 1, 2 or 3 ranks


def make_learner(
    parallelism: str,
    optimizer: str,
    rank: int = 0,
    world: int = 1,
    micro_batch_tokens: int | None = None,
    shared_prompts: bool = True,
) -> LLMLearner:
    # SGD for the invariance (parameters differ exactly as gradients do); Adam, with an eps that keeps float
    # noise on zero-gradient parameters from being blown up to the learning rate, to carry optimizer state.
    trainer = TrainerSpec(
        steps=10,
        optimizer=optimizer,
        learning_rate=0.05 if optimizer == "sgd" else 0.01,
        optimizer_eps=1e-2,
        micro_batch_size=None if micro_batch_tokens else 2,
        micro_batch_tokens=micro_batch_tokens,
        seed=3,
        grad_clip=1.0,
        parallelism=parallelism,
        shared_prompts=shared_prompts,
    )
    return LLMLearner(
        make_model(),
        ALGORITHM,
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
        rank=rank,
        world_size=world,
    )


def full_params(learner: LLMLearner) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (gathered from the shards: every rank must call it)."""
    from rljob.runtime.llm.training.sharding import full_tensor

    return {name: full_tensor(p.detach()).clone() for name, p in learner.model.named_parameters()}


def full_optimizer_state(learner: LLMLearner) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(learner.model, learner.optimizer, options=options).get("state")  # rank 0 only
    return copy.deepcopy(state)  # unsharded, these are the optimizer's own tensors, which the next step changes


def invariance(rank: int, world: int, checkpoints: Path) -> dict:
    """Two updates with fsdp2, then two with ddp, from the same start; their whole parameters."""
    result = {}
    for parallelism in ("fsdp2", "ddp"):
        learner = make_learner(parallelism, "sgd", rank, world)
        result[parallelism + "_sharded"] = learner.sharded
        result[parallelism + "_stats"] = [learner.update(make_samples(seed, SAMPLES)) for seed in (0, 1)]
        result[parallelism] = full_params(learner)
    return result


PACKED_BUDGET = 22  # tokens per pass (a sample is at most 14): 1 to 5 rows, pass counts differ by rank


def packed(rank: int, world: int, checkpoints: Path) -> dict:
    """Two fsdp2 updates in micro-batches by token budget."""
    learner = make_learner("fsdp2", "sgd", rank, world, micro_batch_tokens=PACKED_BUDGET)
    for seed in (0, 1):
        learner.update(make_samples(seed, SAMPLES))
    return {"params": full_params(learner)}


def grouped(rank: int, world: int, checkpoints: Path) -> dict:
    """Two fsdp2 updates on groups of responses to shared prompts: prefix and rows are two forwards of the
    sharded policy before one backward."""
    import rljob.runtime.llm.training.learner

    # Every saving counts here (these tiny prompts save less than fsdp2's default bar): what is checked is the
    # update a shared pass gives, not when to take one.
    rljob.runtime.llm.training.learner.FSDP_MIN_SAVING = 0.0
    learner = make_learner("fsdp2", "sgd", rank, world)
    shared: list[bool] = []
    cut = learner._micro

    def recorded(samples: list[dict]) -> list:
        passes = cut(samples)
        shared.extend(mb.prefix is not None for mb in passes)
        return passes

    learner._micro = recorded  # type: ignore[method-assign]  # the passes the updates ran
    for seed in (0, 1):
        learner.update(make_groups(seed, prompts=6, size=4))
    return {"params": full_params(learner), "shared": shared}


def weight_sync(rank: int, world: int, checkpoints: Path) -> dict:
    """One fsdp2 update, then rank 0 broadcasts the policy to a rollout (a thread of its own) as the actor
    does: one gather per tensor, every rank joining, each bucket built as it is sent."""
    import threading

    from rljob.runtime.llm.training.sharding import weight_source
    from rljob.runtime.weights.sync import WeightPublisher, WeightSubscriber

    learner = make_learner("fsdp2", "sgd", rank, world)
    learner.update(make_samples(0, SAMPLES))
    channel = CommandChannel(rank, world)
    if rank != 0:
        follow(learner, channel)
        return {"params": full_params(learner)}
    port, rollout = free_port(), make_model()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    source = weight_source(learner, channel)
    key = publisher.plan([(0, "rollout-0")], 1, source)[0]
    receiver = threading.Thread(
        target=WeightSubscriber("127.0.0.1", port, 1).receive, args=(key, 1, "actor-a", rollout)
    )
    receiver.start()
    publisher.publish(1, source)
    receiver.join(timeout=60)
    publisher.close()
    channel.send("end")
    received = {name: p.detach().clone() for name, p in rollout.named_parameters()}
    return {"params": full_params(learner), "received": received, "backend": publisher.backend}


def save(rank: int, world: int, checkpoints: Path) -> dict:
    """One fsdp2 update, then a checkpoint as the actor makes one: rank 0 commits, the others follow."""
    learner = make_learner("fsdp2", "adam", rank, world)
    learner.update(make_samples(0, SAMPLES))
    channel = CommandChannel(rank, world)
    if rank == 0:
        save_checkpoint(
            CheckpointManager(checkpoints), learner, learner.step, {"learner": learner.state_dict()}, channel
        )
        channel.send("end")
    else:
        follow(learner, channel)
    return {"params": full_params(learner), "optimizer": full_optimizer_state(learner)}


def resume(rank: int, world: int, checkpoints: Path) -> dict:
    """The newest checkpoint loaded (on however many ranks), then the next update."""
    learner = make_learner("fsdp2", "adam", rank, world)
    _, state, path = CheckpointManager(checkpoints).latest_valid()
    load_checkpoint(learner, state["learner"], path)
    result = {"step": learner.step, "params": full_params(learner), "optimizer": full_optimizer_state(learner)}
    learner.update(make_samples(1, SAMPLES))
    return {**result, "after": full_params(learner)}


LORA_KL = AlgorithmSpec(name="grpo", kl_coef=0.1, loss_aggregation="token-mean", minibatches=2, clip_ratio_high=0.28)


def lora_learner(parallelism: str, rank: int = 0, world: int = 1) -> LLMLearner:
    """A policy with LoRA adapters, its KL measured against the base (adapters off), Adam on the adapters alone."""
    from rljob.api.spec import LoraSpec
    from rljob.runtime.llm.models.lora import add_lora

    model = make_model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)  # A's initialisation: the same here and in the ranks (which take rank 0's anyway)
        add_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    trainer = TrainerSpec(
        steps=10, optimizer="adam", learning_rate=0.01, micro_batch_size=2, seed=3, parallelism=parallelism
    )
    return LLMLearner(
        model,
        LORA_KL,
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
        reference_is_base=True,
        rank=rank,
        world_size=world,
    )


def lora_sync(rank: int, world: int, checkpoints: Path) -> dict:
    """Two fsdp2 updates of a LoRA policy, then rank 0 sends it to a rollout merged and to another as adapters alone
    (every rank joining the gathers), and exports it merged."""
    import threading

    from rljob.runtime.llm.training.sharding import export_policy, weight_source
    from rljob.runtime.weights.sync import WeightPublisher, WeightSubscriber, tensors_report

    learner = lora_learner("fsdp2", rank, world)
    stats = [learner.update(make_samples(seed, SAMPLES)) for seed in (0, 1)]
    channel = CommandChannel(rank, world)
    if rank != 0:
        follow(learner, channel)
        return {}
    received = {}
    for version, adapters_only in ((1, False), (2, True)):
        port = free_port()
        source = weight_source(learner, channel, adapters_only=adapters_only)
        rollout = {
            n: torch.empty(p.shape, dtype=torch.float32)
            for n, p in zip(source.names(), source.placeholders(), strict=True)
        }
        publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
        key = publisher.plan([(0, "rollout-0")], version, source)[0]
        subscriber, tensors = WeightSubscriber("127.0.0.1", port, 1), list(rollout.values())

        def receive(subscriber=subscriber, tensors=tensors, key=key, version=version) -> None:
            subscriber.accept(key, version, "actor-a", tensors_report(tensors))
            subscriber.receive_tensors(key, "actor-a", tensors)

        receiver = threading.Thread(target=receive)
        receiver.start()
        publisher.publish(version, source)
        receiver.join(timeout=60)
        publisher.close()
        received["adapters" if adapters_only else "merged"] = rollout
    export_policy(learner, TOKENIZER, checkpoints / "export", channel)
    channel.send("end")
    return {"stats": stats, "sharded": learner.sharded, **received}


RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from pathlib import Path
    sys.path.insert(0, sys.argv[6])
    import test_sharding
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    port, out, checkpoints, phase = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[7]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(100 + rank)  # ranks must not depend on their own RNG: rank 0's weights are broadcast
    result = getattr(test_sharding, phase)(rank, world, Path(checkpoints))
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where a gloo thread destroyed while joinable aborted a rank
    # once ("terminate called without an active exception", exit -6) after its work was saved.
    sys.stdout.flush()
    os._exit(0)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, phase: str, tmp_path: Path) -> dict:
    out, port, here = tmp_path / f"{phase}-{world}.pt", str(free_port()), str(Path(__file__).parent)
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                str(rank),
                str(world),
                port,
                str(out),
                str(tmp_path / "ckpt"),
                here,
                phase,
            ]
        )
        for rank in range(world)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0] * world
    return torch.load(out, weights_only=False)


def assert_close(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float) -> None:
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.allclose(mine[name], theirs[name], atol=atol), (
            name,
            float((mine[name] - theirs[name]).abs().max()),
        )


def test_fsdp2_with_two_ranks_updates_like_ddp_with_two_ranks_and_like_one_rank(tmp_path):
    single = make_learner("ddp", "sgd")
    stats = [single.update(make_samples(seed, SAMPLES)) for seed in (0, 1)]
    start = full_params(make_learner("ddp", "sgd"))
    two = run_ranks(2, "invariance", tmp_path)
    assert two["fsdp2_sharded"] and not two["ddp_sharded"]
    one = full_params(single)
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-3  # the updates moved the weights
    assert_close(two["fsdp2"], one, atol=1e-6)
    assert_close(two["ddp"], one, atol=1e-6)
    for mine, theirs in zip(stats, two["fsdp2_stats"], strict=True):
        for key in ("policy_loss", "entropy", "clip_fraction", "mismatch_kl", "grad_norm"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5, abs=1e-6), key


def test_fsdp2_ranks_packing_different_micro_batch_counts_update_like_one_rank(tmp_path):
    # Each rank packs its own share: for these samples the ranks' pass counts differ, and sharded ranks must
    # still run as many passes each (their collectives pair up), or the group would hang.
    generator, counts = torch.Generator().manual_seed(3), []
    for seed in (0, 1):
        samples, order = make_samples(seed, SAMPLES), torch.randperm(SAMPLES, generator=generator).tolist()
        for start in range(0, SAMPLES, SAMPLES // 4):  # 2 minibatches x 2 ranks, in the learner's order
            lengths = [len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]) for i in order[start:][:6]]
            counts.append(len(pack_by_tokens(lengths, PACKED_BUDGET)))
    assert any(counts[k] != counts[k + 1] for k in range(0, len(counts), 2))
    single = make_learner("ddp", "sgd")
    for seed in (0, 1):
        single.update(make_samples(seed, SAMPLES))
    assert_close(run_ranks(2, "packed", tmp_path)["params"], full_params(single), atol=1e-6)


def test_fsdp2_ranks_sharing_prompt_prefixes_update_like_one_rank_on_whole_rows(tmp_path):
    single = make_learner("ddp", "sgd", shared_prompts=False)
    for seed in (0, 1):
        single.update(make_groups(seed, prompts=6, size=4))
    two = run_ranks(2, "grouped", tmp_path)
    assert any(two["shared"])  # rank 0 ran shared prefixes
    assert_close(two["params"], full_params(single), atol=1e-6)


def test_a_checkpoint_of_two_sharded_ranks_resumes_on_one_rank_and_on_three(tmp_path):
    continuous = make_learner("ddp", "adam")
    continuous.update(make_samples(0, SAMPLES))
    after_first = full_params(continuous)
    continuous.update(make_samples(1, SAMPLES))
    saved = run_ranks(2, "save", tmp_path)
    assert_close(saved["params"], after_first, atol=1e-6)
    files = sorted(p.relative_to(tmp_path / "ckpt").as_posix() for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert "step-00000001/state.pt" in files and "step-00000001/sharded/.metadata" in files
    assert len([f for f in files if f.endswith(".distcp")]) == 2  # one shard file per rank
    for world in (1, 3):  # one rank: no process group, the shards read back whole
        resumed = resume(0, 1, tmp_path / "ckpt") if world == 1 else run_ranks(world, "resume", tmp_path)
        assert resumed["step"] == 1
        # Resharded exactly: the same whole parameters and Adam moments as the two ranks saved.
        assert_close(resumed["params"], saved["params"], atol=0.0)
        assert resumed["optimizer"].keys() == saved["optimizer"].keys()
        for name, moments in saved["optimizer"].items():
            for key, value in moments.items():
                assert torch.equal(resumed["optimizer"][name][key], value), (world, name, key)
        # The next update continues the run as if it had never stopped.
        assert_close(resumed["after"], full_params(continuous), atol=1e-5)


def test_a_sharded_policy_reaches_a_rollout_whole_through_the_weight_sync(tmp_path):
    start = full_params(make_learner("ddp", "sgd"))
    two = run_ranks(2, "weight_sync", tmp_path)
    assert two["backend"] == "gloo"  # CPU ranks; on GPUs the gathered buckets stay on the device (tests/gpu)
    assert max(float((two["params"][k] - start[k]).abs().max()) for k in start) > 1e-3  # the update moved them
    assert two["received"].keys() == two["params"].keys()
    for name, whole in two["params"].items():
        assert torch.equal(two["received"][name], whole), name


def test_a_sharded_lora_policy_updates_like_one_rank_and_reaches_rollouts_merged_or_as_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    from rljob.runtime.llm.models.lora import adapter_file_state, merged_state_dict

    single = lora_learner("ddp")
    stats = [single.update(make_samples(seed, SAMPLES)) for seed in (0, 1)]
    two = run_ranks(2, "lora_sync", tmp_path)
    assert two["sharded"]
    for mine, theirs in zip(stats, two["stats"], strict=True):
        for key in ("policy_loss", "kl", "entropy", "grad_norm"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
    assert two["stats"][1]["kl"] > 0.0  # measured against the base with the adapters off, on every rank
    expected = merged_state_dict(single.model)
    assert list(two["merged"]) == list(expected)  # the base model's names and order: what a rollout holds
    assert_close(two["merged"], expected, atol=1e-5)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(two["merged"][q], make_model().state_dict()[q], atol=1e-4)  # the adapters are in it
    assert_close(two["adapters"], adapter_file_state(single.model), atol=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "export").state_dict()
    assert_close({k: exported[k] for k in expected}, expected, atol=1e-5)
