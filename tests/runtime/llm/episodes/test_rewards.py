"""Reward functions: builtins, user functions, failures that score 0 and are counted, concurrency, the role."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from rljob.api.spec import RewardSpec
from rljob.launch.local import free_ports
from rljob.runtime.llm.episodes.rewards import (
    RewardConfigError,
    RewardInput,
    RewardScorer,
    check_reward_spec,
    exact_match,
    final_answer,
    format_match,
    length_penalty,
    load_user_function,
    math_verify,
    multiple_choice,
)
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, local_identities, ports_needed
from rljob.runtime.wire.transport import RequestClient

REPO = Path(__file__).resolve().parents[4]


def sample(response: str, answer: str = "19", **fields) -> RewardInput:
    return {
        "prompt": "12+7=",
        "response": response,
        "row": {"prompt": "12+7=", "answer": answer},
        "finish_reason": fields.get("finish_reason", "stop"),
        "response_tokens": fields.get("response_tokens", 4),
    }


def reward(*functions: dict, timeout: float = 10.0, concurrency: int = 4) -> RewardSpec:
    return RewardSpec.model_validate(
        {"functions": list(functions), "sandbox": {"timeoutSeconds": timeout, "maxConcurrency": concurrency}}
    )


@pytest.fixture(autouse=True)
def _modules_readable_by_the_sandbox(tmp_path):
    """pytest makes tmp_path 0700; run as root, the sandboxed worker imports user modules as a uid of its own,
    which needs the module's directory searchable (the 0700 directories above it may stay as they are)."""
    tmp_path.chmod(0o755)


@pytest.fixture
def scorers():
    made: list[RewardScorer] = []

    def make(spec: RewardSpec, **kwargs) -> RewardScorer:
        made.append(RewardScorer(spec, **kwargs))
        return made[-1]

    yield make
    for scorer in made:
        scorer.close()


# --- builtins ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is 19.", "19", 1.0),
        ("19", "19", 1.0),
        ("12 + 7 = 19", "19", 1.0),
        ("The answer is 18.", "19", 0.0),
        ("3 - 10 = -7", "-7", 1.0),
        ("7", "-7", 0.0),
        ("It costs 1,234 dollars", "1234", 1.0),
        ("1,234.50", "1234.5", 1.0),
        ("19.0", "19", 1.0),
        ("Paris.", "paris", 1.0),
        ("I think\nLyon. ", "Paris", 0.0),
        ("", "19", 0.0),
    ],
)
def test_exact_match_compares_the_normalised_final_answer(response, answer, expected):
    assert exact_match("", response, {"answer": answer}) == expected


def test_final_answer_takes_the_last_number_else_the_last_line():
    assert final_answer("first 3, then 1,000,000.") == "1000000"
    assert final_answer("a 1, 2") == "2"
    assert final_answer("Thinking...\n  The Capital Is PARIS. \n") == "the capital is paris"


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("B", 1.0),
        ("The answer is (B).", 1.0),
        ("<think>A looks wrong, C too</think> \\boxed{B}", 1.0),  # the boxed letter, not the last lone one
        ("Answer: C", 0.0),
        ("the answer is a circle, so B", 1.0),  # the article "a" is not option A
        ("4", 1.0),  # the correct option's text, stated alone
        ("4 or five", 0.0),  # two options' texts: no pick
        ("E", 0.0),  # not an option of this row (three options)
        ("", 0.0),
    ],
)
def test_multiple_choice_scores_the_option_letter_the_response_picks(response, expected):
    row = {"prompt": "2+2?", "choices": ["3", "4", "five"], "answer": "B"}
    assert multiple_choice("", response, row) == expected


def test_multiple_choice_reads_an_answer_given_as_a_letter_an_index_or_the_options_text():
    for answer in ("B", "(b)", 1, "4"):
        assert multiple_choice("", "B", {"choices": ["3", "4"], "answer": answer}) == 1.0, answer
    with pytest.raises(KeyError, match="neither an option letter nor one of its 'choices'"):
        multiple_choice("", "B", {"choices": ["3", "4"], "answer": "seven"})


def test_exact_match_reads_the_answer_key_it_is_given():
    assert exact_match("", "42", {"label": 42}, answer_key="label") == 1.0
    with pytest.raises(KeyError, match=re.escape("the dataset row has no 'answer' (keys: label)")):
        exact_match("", "42", {"label": 42})


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("so the result is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("The answer is 19.", "19", 1.0),
        ("\\boxed{3}", "4", 0.0),
    ],
)
def test_math_verify_finds_equivalent_answers(response, answer, expected):
    assert math_verify("", response, {"answer": answer}) == expected


def test_format_fully_matches_the_stripped_response_unless_asked_to_search():
    assert format_match("", " -19\n", {}, pattern=r"-?[0-9]+") == 1.0
    assert format_match("", "x = 19", {}, pattern=r"-?[0-9]+") == 0.0
    assert format_match("", "x = 19", {}, pattern=r"-?[0-9]+", search=True) == 1.0
    assert format_match("", "<think>a</think> 3", {}, pattern=r"<think>.*</think>.*") == 1.0


def test_length_penalty_punishes_truncated_or_overlong_responses():
    assert length_penalty("", "", {}, finish_reason="length", response_tokens=8) == -1.0
    assert length_penalty("", "", {}, finish_reason="stop", response_tokens=8) == 0.0
    # Soft overlong penalty: free up to 80 tokens, then linear to -1 at 100, -1 beyond.
    soft = {"max_tokens": 100, "buffer_tokens": 20}
    assert length_penalty("", "", {}, response_tokens=80, **soft) == 0.0
    assert length_penalty("", "", {}, response_tokens=90, **soft) == pytest.approx(-0.5)
    assert length_penalty("", "", {}, response_tokens=100, **soft) == -1.0
    assert length_penalty("", "", {}, response_tokens=150, **soft) == -1.0
    assert length_penalty("", "", {}, response_tokens=101, max_tokens=100) == -1.0


def test_scorer_sums_weighted_terms_and_reports_each_unweighted(scorers):
    scorer = scorers(
        reward(
            {"builtin": "exact_match", "weight": 1.0},
            {"builtin": "format", "weight": 0.1, "args": {"pattern": "^-?[0-9]+$"}},
            {"builtin": "format", "weight": 0.5, "args": {"pattern": "19", "search": True}},
            {"name": "too_long", "builtin": "length_penalty", "weight": 2.0},
        )
    )
    assert scorer.names == ["exact_match", "format", "format_2", "too_long"]
    scored = scorer.score(
        [sample("19"), sample("The answer is 19."), sample("18", finish_reason="length"), sample("nope")]
    )
    assert scored.terms == {
        "exact_match": [1.0, 1.0, 0.0, 0.0],
        "format": [1.0, 0.0, 1.0, 0.0],
        "format_2": [1.0, 1.0, 0.0, 0.0],
        "too_long": [0.0, 0.0, -1.0, 0.0],
    }
    assert scored.rewards == pytest.approx([1.6, 1.5, -1.9, 0.0])
    assert scored.errors == {"exact_match": 0, "format": 0, "format_2": 0, "too_long": 0}


def test_scorer_reads_the_dataset_answer_key_unless_args_override_it(scorers):
    rows = [{**sample("7"), "row": {"label": "7", "answer": "8"}}]
    assert scorers(reward({"builtin": "exact_match"}), answer_key="label").score(rows).rewards == [1.0]
    spec = reward({"builtin": "exact_match", "args": {"answer_key": "answer"}})
    assert scorers(spec, answer_key="label").score(rows).rewards == [0.0]


# --- user functions ------------------------------------------------------------------------------

USER_REWARDS = """\
import math
import time

def contains(prompt, response, row, *, word):
    return float(word in response)

def truncated(prompt, response, row, finish_reason):
    return -1.0 if finish_reason == "length" else 0.0

def per_token(prompt, response, row, **kwargs):
    return kwargs["response_tokens"] / 10

def explodes(prompt, response, row):
    if response == "boom":
        raise RuntimeError("boom happened")
    return 1.0

def text(prompt, response, row):
    return "abc" if response == "boom" else 1

def not_a_number(prompt, response, row):
    return math.nan if response == "boom" else True

def hangs(prompt, response, row):
    if response == "boom":
        time.sleep(600)  # its sandboxed worker is SIGKILLed at the wall clock
    return 1.0

threshold = 0.5
"""


def test_user_function_from_a_file_receives_its_args_and_the_sample_fields_it_asks_for(tmp_path, scorers):
    (tmp_path / "rewards.py").write_text(USER_REWARDS)
    scorer = scorers(
        reward(
            {"module": "rewards.py:contains", "args": {"word": "cat"}},
            {"module": "rewards.py:truncated", "weight": 0.5},
            {"module": f"{tmp_path / 'rewards.py'}:per_token"},
        ),
        base_dir=tmp_path,
    )
    assert scorer.names == ["contains", "truncated", "per_token"]
    scored = scorer.score([sample("a cat", response_tokens=3), sample("a dog", finish_reason="length")])
    assert scored.terms == {"contains": [1.0, 0.0], "truncated": [0.0, -1.0], "per_token": [0.3, 0.4]}
    assert scored.rewards == pytest.approx([1.3, -0.1])


def test_user_function_from_an_importable_package(tmp_path, monkeypatch, scorers):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text("def shout(prompt, response, row):\n    return float(response.isupper())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_user_function("my_rewards.scoring:shout")("", "YES", {}) == 1.0
    scorer = scorers(reward({"name": "loud", "module": "my_rewards.scoring:shout"}))
    assert scorer.score([sample("NO"), sample("no")]).terms == {"loud": [1.0, 0.0]}


@pytest.mark.parametrize(
    ("files", "ref", "args", "field", "message"),
    [
        ({}, "./missing.py:score", {}, "module", "file ./missing.py does not exist (relative paths are resolved"),
        (
            {"rewards.py": USER_REWARDS},
            "rewards.py:score",
            {},
            "module",
            "rewards.py has no function 'score' (defines: contains, explodes, hangs, not_a_number, per_token, text",
        ),
        ({"rewards.py": USER_REWARDS}, "rewards.py:threshold", {}, "module", "rewards.py:threshold is not callable"),
        ({"broken.py": "def score(:\n"}, "broken.py:score", {}, "module", "SyntaxError: invalid syntax (line 1)"),
        (
            {"importer.py": "import not_a_real_package\n"},
            "importer.py:score",
            {},
            "module",
            "ModuleNotFoundError: No module named 'not_a_real_package'",
        ),
        ({}, "not_a_real_package.scoring:score", {}, "module", "cannot import 'not_a_real_package.scoring'"),
        ({}, "rewards/score:score", {}, "module", "a file reference must name a .py file"),
        (
            {"rewards.py": USER_REWARDS},
            "rewards.py:contains",
            {"wrod": "cat"},
            "args",
            "cannot be called as fn(prompt, response, row, **args)",
        ),
    ],
)
def test_unusable_user_function_is_an_error_naming_the_field(tmp_path, files, ref, args, field, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    spec = reward({"builtin": "exact_match"}, {"module": ref, "args": args})
    problems = check_reward_spec(spec, tmp_path)
    assert len(problems) == 1
    assert problems[0][0] == f"spec.reward.functions[1].{field}"
    assert message in problems[0][1]
    with pytest.raises(RewardConfigError) as caught:
        RewardScorer(spec, base_dir=tmp_path)
    assert str(caught.value).startswith(f"spec.reward.functions[1].{field}: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("function", "field", "message"),
    [
        ({"builtin": "code_exec", "args": {"tests": 3}}, "args.tests", "must name the dataset column"),
        ({"builtin": "code_exec", "args": {"test": "tests"}}, "args.test", "code_exec does not take 'test'"),
        ({"builtin": "format"}, "args.pattern", "format needs a regex string"),
        ({"builtin": "format", "args": {"pattern": "x("}}, "args.pattern", "'x(' is not a valid regex: missing )"),
        (
            {"builtin": "exact_match", "args": {"answerkey": "label"}},
            "args.answerkey",
            "exact_match does not take 'answerkey' (it takes: answer_key)",
        ),
        ({"builtin": "length_penalty", "args": {"max_tokens": 0}}, "args.max_tokens", "must be a positive integer"),
        (
            {"builtin": "length_penalty", "args": {"max_tokens": 10, "buffer_tokens": 10}},
            "args.buffer_tokens",
            "from 0 to max_tokens - 1",
        ),
    ],
)
def test_unusable_builtin_is_an_error_naming_the_field(function, field, message):
    problems = check_reward_spec(reward(function))
    assert problems == [(f"spec.reward.functions[0].{field}", problems[0][1])]
    assert message in problems[0][1]


# --- failures and concurrency --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("explodes", "RuntimeError: boom happened"),
        ("text", "returned 'abc', not a finite number"),
        ("not_a_number", "returned nan, not a finite number"),
        ("hangs", "killed after the wall-clock limit (spec.reward.sandbox.timeoutSeconds: 0.5s)"),
    ],
)
def test_a_failing_call_scores_zero_and_is_counted_while_the_rest_still_score(tmp_path, scorers, function, error):
    (tmp_path / "rewards.py").write_text(USER_REWARDS)
    # One worker: a hung call's worker must be killed and replaced, or the samples after it never score.
    spec = reward({"builtin": "exact_match"}, {"module": f"rewards.py:{function}"}, timeout=0.5, concurrency=1)
    scorer = scorers(spec, base_dir=tmp_path)
    scored = scorer.score([sample("boom"), sample("19"), sample("The answer is 19."), sample("boom")])
    assert scored.terms == {"exact_match": [0.0, 1.0, 1.0, 0.0], function: [0.0, 1.0, 1.0, 0.0]}
    assert scored.rewards == [0.0, 2.0, 2.0, 0.0]
    assert scored.errors == {"exact_match": 0, function: 2}
    assert error in scored.error_messages[function]
    # The scorer keeps working after a failure.
    assert scorer.score([sample("19")]).errors == {"exact_match": 0, function: 0}


def test_scoring_beats_the_heartbeat_as_calls_end_so_a_slow_batch_is_not_taken_for_a_hung_one(tmp_path, scorers):
    """A batch whose every call runs into the time limit takes calls x limit / concurrency: the reward role's loop
    beats at each call that ends, so its liveness limit bounds one call, not the batch."""
    import time

    (tmp_path / "rewards.py").write_text(USER_REWARDS)
    spec = reward({"module": "rewards.py:hangs"}, timeout=0.5, concurrency=1)
    scorer = scorers(spec, base_dir=tmp_path)
    beats: list[float] = []
    started = time.monotonic()
    scored = scorer.score([sample("boom")] * 4, beat=lambda: beats.append(time.monotonic()))
    took = time.monotonic() - started
    assert scored.errors == {"hangs": 4}
    assert took >= 2.0  # four calls of at least 0.5 s, one at a time
    gaps = [b - a for a, b in zip([started, *beats], [*beats, started + took], strict=True)]
    assert len(beats) >= 4 and max(gaps) < took / 2, gaps


CONCURRENCY_PROBE = """\
import socket

def probe(prompt, response, row, *, port):
    # Waits at the test's barrier (a TCP listener) until it lets {n} calls through at once.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as barrier:
        return float(barrier.recv(16).decode())
"""


def test_scoring_runs_max_concurrency_calls_at_once_in_separate_workers(tmp_path, scorers):
    # Each call holds a connection open until 3 are open together: fewer workers would never get there (the
    # calls would time out), and the test's listener reports how many it held when it let them go.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]

        def barrier() -> None:
            for _ in range(3):  # 9 samples: 3 rounds of 3
                held = [listener.accept()[0] for _ in range(3)]
                for connection in held:
                    connection.sendall(str(len(held)).encode())
                    connection.close()

        releaser = threading.Thread(target=barrier, daemon=True)
        releaser.start()
        (tmp_path / "probe.py").write_text(CONCURRENCY_PROBE.format(n=3))
        spec = RewardSpec.model_validate(
            {
                "functions": [{"module": "probe.py:probe", "args": {"port": port}}],
                "sandbox": {"timeoutSeconds": 60, "maxConcurrency": 3, "network": True},
            }
        )
        scorer = scorers(spec, base_dir=tmp_path)
        scored = scorer.score([sample(str(i)) for i in range(9)])
        releaser.join(timeout=60)
    assert scored.errors == {"probe": 0}
    assert scored.terms["probe"] == [3.0] * 9
    assert len(scorer._modules[0].worker_pids()) == 3  # and no more workers than maxConcurrency


def test_a_worker_imports_the_module_once_and_keeps_its_state_between_samples(tmp_path, scorers):
    (tmp_path / "counter.py").write_text(
        "calls = 0\n\ndef count(prompt, response, row):\n    global calls\n    calls += 1\n    return float(calls)\n"
    )
    scorer = scorers(reward({"module": "counter.py:count"}, concurrency=1), base_dir=tmp_path)
    assert scorer.score([sample("a"), sample("b"), sample("c")]).terms["count"] == [1.0, 2.0, 3.0]


# --- the role ------------------------------------------------------------------------------------


def reward_role(tmp_path, extra_functions: list[dict] | None = None) -> tuple[str, dict[str, str]]:
    """Endpoint and environment of a reward role for examples/grpo-tiny-arithmetic.yaml with known rewards."""
    job = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    job["spec"]["reward"]["functions"] = [
        {"builtin": "exact_match", "weight": 1.0},
        {"builtin": "format", "weight": 0.1, "args": {"pattern": "^-?[0-9]+$"}},
        *(extra_functions or []),
    ]
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    replicas = {"actor": 1, "rollout": 1, "env": 0, "reward": 1}
    identities = local_identities("grpo", replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path))
    identity = next(i for i in identities if i.role == "reward")
    # The second test runs the role from tmp_path: keep this checkout's rljob importable there.
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return identity.endpoints["reward"][0], {**os.environ, **identity.to_env(), "PYTHONPATH": python_path}


def test_reward_role_scores_samples_over_the_transport_and_warns_once_per_failing_function(tmp_path):
    (tmp_path / "rewards.py").write_text(USER_REWARDS)
    endpoint, env = reward_role(tmp_path, [{"module": "rewards.py:explodes", "weight": 0.0}])
    role = subprocess.Popen(
        [sys.executable, "-m", "rljob.cli.main", "role", "reward"],
        env=env,
        cwd=tmp_path,  # where rewards.py is found
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = RequestClient(endpoint, timeout=2.0, retries=60)  # the role takes a few seconds to start
    try:
        assert "tag" in client.call("status")
        samples = [sample("19"), sample("The answer is 19."), sample("20"), sample("boom")]
        reply = client.call("score", {"samples": samples})
        assert reply["rewards"].dtype == np.float32
        assert reply["rewards"].tolist() == pytest.approx([1.1, 1.0, 0.1, 0.0])
        assert reply["terms"] == {
            "exact_match": [1.0, 1.0, 0.0, 0.0],
            "format": [1.0, 0.0, 1.0, 0.0],
            "explodes": [1.0, 1.0, 1.0, 0.0],
        }
        assert reply["errors"] == {"exact_match": 0, "format": 0, "explodes": 1}
        assert client.call("score", {"samples": [sample("boom")]})["errors"]["explodes"] == 1
    finally:
        client.close()
        role.send_signal(signal.SIGTERM)
        output = role.communicate(timeout=60)[0]
    assert role.returncode == 0, output
    assert output.count("reward function explodes failed") == 1, output
    assert "RuntimeError: boom happened" in output


def test_reward_role_with_a_missing_user_module_exits_with_the_fatal_config_code(tmp_path):
    _, env = reward_role(tmp_path, [{"module": "my_rewards.py:score"}])
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "role", "reward"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,  # a safety net: the role exits as soon as it has tried to load the function
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_FATAL_CONFIG, output
    assert "spec.reward.functions[2].module: file my_rewards.py does not exist" in output
    assert str(tmp_path) in output
    assert "Traceback" not in output


def test_reward_role_refuses_a_gym_job(tmp_path):
    config = REPO / "examples" / "cartpole-ppo.yaml"
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 1}
    identities = local_identities("gym", replicas, str(config), free_ports(ports_needed(replicas)))
    identity = next(i for i in identities if i.role == "reward")
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "role", "reward"],
        env={**os.environ, **identity.to_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_FATAL_CONFIG, result.stderr  # a configuration error: never retried
    assert "task.type gym jobs run the roles actor, env, rollout; set spec.roles.reward.replicas to 0" in (
        result.stderr
    )
