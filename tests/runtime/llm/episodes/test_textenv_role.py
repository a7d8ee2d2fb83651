"""The env role of an llm job: `rljob role env` serves task.llm.env over the transport, or exits 78."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from rljob.launch.local import free_ports
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, local_identities, ports_needed
from rljob.runtime.wire.transport import RequestClient

REPO = Path(__file__).resolve().parents[4]

FLAKY_TOOL = """
from rljob.runtime.llm.episodes.textenv import TextEnv


class Flaky(TextEnv):
    def step(self, messages, response):
        if response == "boom":
            raise RuntimeError("the tool fell over")
        return [{"role": "tool", "content": response.upper()}], 1.0, False, {"tool_calls": 1}
"""


def env_role(tmp_path, env: dict) -> tuple[str, dict[str, str]]:
    """Endpoint and environment of the env role of examples/grpo-tiny-calculator.yaml with `env` as task.llm.env."""
    job = yaml.safe_load((REPO / "examples" / "grpo-tiny-calculator.yaml").read_text())
    job["spec"]["task"]["llm"]["env"] = env
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 1}
    identities = local_identities("calc", replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path))
    identity = next(i for i in identities if i.role == "env")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return identity.endpoints["env"][0], {**os.environ, **identity.to_env(), "PYTHONPATH": python_path}


def start(env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rljob.cli.main", "role", "env"],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_env_role_serves_the_calculator_over_the_transport(tmp_path):
    endpoint, env = env_role(tmp_path, {"builtin": "calculator", "maxTurns": 3})
    role = start(env, tmp_path)
    client = RequestClient(endpoint, timeout=2.0, retries=60)  # the role takes a few seconds to start
    try:
        assert client.call("status")["env"] == "calculator"
        assert client.call("reset", {"rows": [{"prompt": "2+3=", "answer": "5"}]})["messages"] == [[]]
        episodes = [
            {"messages": [], "response": "calc(2+3)", "row": {}},
            {"messages": [], "response": "calc(__import__('os'))", "row": {}},
            {"messages": [{"role": "assistant", "content": "calc(2+3)"}], "response": "5", "row": {}},
        ]
        results = client.call("step", {"episodes": episodes})["results"]
        assert results == [
            {
                "messages": [{"role": "tool", "content": "= 5\n"}],
                "reward": 0.0,
                "done": False,
                "info": {"tool_calls": 1, "tool_errors": 0},
            },
            {
                "messages": [
                    {
                        "role": "tool",
                        "content": "= error: Call is not allowed: numbers, + - * / // % ** and parentheses only\n",
                    }
                ],
                "reward": 0.0,
                "done": False,
                "info": {"tool_calls": 1, "tool_errors": 1},
            },
            {"messages": [], "reward": 0.0, "done": True, "info": {"tool_calls": 0, "tool_errors": 0}},
        ]
    finally:
        client.close()
        role.send_signal(signal.SIGTERM)
        output = role.communicate(timeout=60)[0]
    assert role.returncode == 0, output
    assert "serving the text environment calculator (maxTurns 3)" in output


def test_a_user_env_that_raises_ends_that_episode_only_and_is_counted(tmp_path):
    (tmp_path / "tools.py").write_text(FLAKY_TOOL)
    endpoint, env = env_role(tmp_path, {"module": "tools.py:Flaky"})
    role = start(env, tmp_path)
    client = RequestClient(endpoint, timeout=2.0, retries=60)
    try:
        episodes = [{"messages": [], "response": r, "row": {}} for r in ("ab", "boom", "cd")]
        reply = client.call("step", {"episodes": episodes})
        assert [r["messages"] for r in reply["results"]] == [
            [{"role": "tool", "content": "AB"}],
            [],
            [{"role": "tool", "content": "CD"}],
        ]
        assert reply["results"][1] == {
            "messages": [],
            "reward": 0.0,
            "done": True,
            "info": {"error": "RuntimeError: the tool fell over"},
        }
        assert client.call("step", {"episodes": episodes[1:2]})["errors"] == 2
    finally:
        client.close()
        role.send_signal(signal.SIGTERM)
        output = role.communicate(timeout=60)[0]
    assert role.returncode == 0, output
    assert output.count("text env tools.py:Flaky step raised") == 1, output


def test_an_env_class_that_does_not_exist_exits_with_the_fatal_config_code(tmp_path):
    (tmp_path / "tools.py").write_text(FLAKY_TOOL)
    _, env = env_role(tmp_path, {"module": "tools.py:Calculator"})
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "role", "env"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,  # a safety net: the role exits as soon as it has tried to load the class
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_FATAL_CONFIG, output
    assert "spec.task.llm.env.module: tools.py has no class 'Calculator' (classes defined: Flaky, TextEnv)" in output
    assert "Traceback" not in output
