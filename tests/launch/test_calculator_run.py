"""`rljob run` of multi-turn llm jobs end to end: the calculator example, a user environment, bad input."""

from __future__ import annotations

import re

import pytest
import yaml

from rljob.runtime.records.checkpoint import CheckpointManager

EXAMPLE = "examples/grpo-tiny-calculator.yaml"
SHORT = ("--set=spec.trainer.batchSize=8", "--set=spec.logging.tensorboard=false", "--quiet")
EPISODE_KEYS = ("turns_mean", "tool_call_rate", "tool_calls_mean", "env_reward_mean", "env_errors")

ALWAYS_ANSWERS = '''
from rljob.runtime.llm.episodes.textenv import TextEnv


class AlwaysAnswers(TextEnv):
    """Replies to every turn and ends the episode after the second: whatever the model writes."""

    def step(self, messages, response, row):
        second = any(m["role"] == "assistant" for m in messages)
        return [{"role": "tool", "content": "= " + row["answer"] + "\\n"}], 0.5, second, {"tool_calls": 1}
'''


def split_phases(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(warm-up records, RL records) of a metrics.jsonl."""
    return [r for r in records if r.get("phase") == "sft"], [r for r in records if "phase" not in r]


def job_with(repo, tmp_path, **env) -> str:
    job = yaml.safe_load((repo / EXAMPLE).read_text())
    job["spec"]["task"]["llm"]["env"] = env
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


# The warm-up's first example, as the actor logs it: the call, the calculator's reply (from the env role, not
# trained on), then the answer turn, which is the reply's value; each turn ends with the end-of-sequence token.
WHOLE_EPISODE = re.compile(
    r"supervised warm-up: first example '(\d+\+\d+)=' model\['calc\(\1\)([^']+)'\] env\['= (\d+)\\n'\] "
    r"model\['\3\2'\]"
)


@pytest.mark.slow
def test_grpo_tiny_calculator_runs_episodes_through_the_env_role(repo, start_run):
    run = start_run(
        repo / EXAMPLE,
        "--set=spec.sft.steps=200",
        "--set=spec.trainer.steps=3",
        "--set=spec.evaluation.interval=3",
        "--set=spec.evaluation.size=16",
        "--set=spec.checkpoint.interval=0",
        *SHORT,
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    warmup, records = split_phases(run.metrics())
    assert [r["step"] for r in records] == [1, 2, 3]
    # The supervised warm-up ran first (spec.sft) on whole episodes: call, calculator reply, answer.
    assert [r["sft_step"] for r in warmup] == list(range(1, 201))
    assert all(r["step"] == 0 for r in warmup)
    assert warmup[-1]["sft_loss"] < 0.5 * warmup[0]["sft_loss"], (warmup[0], warmup[-1])
    actor_log = (run.out / "logs" / "actor-0.log").read_text()
    example = WHOLE_EPISODE.search(actor_log)
    assert example is not None, actor_log
    a, b = map(int, example.group(1).split("+"))
    assert int(example.group(3)) == a + b  # the env role's calculator computed the reply
    assert "environment replies from the env role" in actor_log
    # So the first RL episodes call the tool, then answer with a bare number (the `format` reward's pattern).
    first = records[0]
    assert first["tool_call_rate"] > 0.5 and first["turns_mean"] > 1.5 and first["reward/format"] > 0.5, first
    for record in records:
        for key in EPISODE_KEYS:
            assert record.get(key) is not None, (record["step"], key)
        assert 1.0 <= record["turns_mean"] <= 2.0  # task.llm.env.maxTurns 2
        assert 0.0 <= record["tool_call_rate"] <= 1.0
        assert record["env_errors"] == 0 and record["env_reward_mean"] == 0.0  # the calculator scores nothing
        assert record["mismatch_kl"] < 1e-6
    assert "eval_turns_mean" in records[-1] and "eval_tool_call_rate" in records[-1]
    assert "serving the text environment calculator (maxTurns 2)" in (run.out / "logs" / "env-0.log").read_text()
    assert not run.roles()


@pytest.mark.slow
def test_a_user_environment_from_a_file_gets_two_turns_whose_replies_are_not_trained_on(repo, tmp_path, start_run):
    tools = tmp_path / "tools.py"
    tools.write_text(ALWAYS_ANSWERS)
    run = start_run(
        job_with(repo, tmp_path, module=f"{tools}:AlwaysAnswers", maxTurns=2),
        "--set=spec.sft.steps=1",  # the environment answers whatever the model writes: no warm-up needed
        "--set=spec.trainer.steps=2",
        "--set=spec.evaluation.interval=0",
        "--set=spec.evaluation.size=0",
        *SHORT,
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    for record in split_phases(run.metrics())[1]:
        assert record["turns_mean"] == 2.0 and record["tool_call_rate"] == 1.0
        assert record["env_reward_mean"] == 1.0  # 0.5 per step, two steps
        # The reply `= ANSWER\n` sits between the turns: in the response, never among the trained tokens.
        episodes = 8 * 8
        assert record["response_tokens"] <= record["response_length_mean"] * episodes - 4 * episodes
        assert record["reward_mean"] >= 1.0  # the env's 1.0 plus the reward functions of the final turn


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "problem"),
    [
        (
            {"module": "tools.py:Calculater"},
            "spec.task.llm.env.module: file tools.py does not exist",
        ),
        ({"builtin": "calculator", "maxTurns": 33}, "spec.task.llm.env.maxTurns: must be <= 32 (got 33)"),
        ({"builtin": "calculator", "args": {"precision": 3}}, "spec.task.llm.env.args: calculator cannot be built"),
    ],
    ids=["missing-class-file", "max-turns-out-of-range", "unknown-arg"],
)
def test_bad_text_env_input_is_refused_before_any_role_starts(repo, tmp_path, start_run, env, problem):
    run = start_run(job_with(repo, tmp_path, **env), "--set=spec.trainer.steps=2", "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert problem in output, output
    assert "Traceback" not in output, output
    assert not (run.out / "logs").exists() or not list((run.out / "logs").iterdir())  # no role process started
    assert not run.roles()


@pytest.mark.slow
def test_an_env_class_missing_from_its_file_is_refused_before_any_role_starts(repo, tmp_path, start_run):
    tools = tmp_path / "tools.py"
    tools.write_text(ALWAYS_ANSWERS)
    run = start_run(job_with(repo, tmp_path, module=f"{tools}:Calculator"), "--set=spec.trainer.steps=2", "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert "spec.task.llm.env.module: " in output and "has no class 'Calculator'" in output, output
    assert "Traceback" not in output, output
    assert not run.roles()


@pytest.mark.slow
def test_a_resumed_run_does_not_repeat_the_warm_up_and_continues_the_prompt_stream(repo, start_run):
    settings = (
        "--set=spec.sft.steps=12",
        "--set=spec.checkpoint.interval=2",
        "--set=spec.evaluation.interval=0",
        "--set=spec.evaluation.size=0",
        *SHORT,
    )
    first = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=2", *settings, name="sft-resumed")
    output = first.finish()
    assert first.process.returncode == 0, output
    assert "sft step 12/12" in (first.out / "logs" / "actor-0.log").read_text()

    again = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=4", *settings, name="sft-resumed")
    output = again.finish()
    assert again.process.returncode == 0, output
    log = (again.out / "logs" / "actor-0.log").read_text()
    assert "supervised warm-up: 12 steps done before the checkpoint, not repeated" in log, log
    assert "sft step" not in log[log.index("resumed from") :]  # the log file holds both runs
    warmup, records = split_phases(again.metrics())
    assert [r["sft_step"] for r in warmup] == list(range(1, 13))  # the first run's, kept once
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    manager = CheckpointManager(again.out / "checkpoints", keep=10)
    states = {step: manager.load(path)[1] for step, path in manager.checkpoints()}
    assert {step: state["sft_steps"] for step, state in states.items()} == {2: 12, 4: 12}
    # The warm-up walks its own order: RL took exactly batchSize prompts per step, from the stream's start.
    assert {step: state["stream"] for step, state in states.items()} == {
        2: {"epoch": 0, "position": 16},
        4: {"epoch": 0, "position": 32},
    }


@pytest.mark.slow
def test_a_warm_up_turn_field_the_rows_lack_is_refused_before_any_role_starts(repo, start_run):
    run = start_run(repo / EXAMPLE, '--set=spec.sft.turns=["calc({expression})", "{result}"]', "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert "spec.sft.turns[1]: reads {result}, but row 0 of the dataset has no column 'result'" in output
    assert "Traceback" not in output, output
    assert not (run.out / "logs").exists() or not list((run.out / "logs").iterdir())
    assert not run.roles()


@pytest.mark.slow
def test_more_warm_up_turns_than_the_environment_allows_are_refused_before_any_role_starts(repo, start_run):
    run = start_run(repo / EXAMPLE, "--set=spec.task.llm.env.maxTurns=1", "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert "spec.sft.turns: 2 turns, but an episode has at most task.llm.env.maxTurns (1)" in output, output
    assert "Traceback" not in output, output
    assert not run.roles()
