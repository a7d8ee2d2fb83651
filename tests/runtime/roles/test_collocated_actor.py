"""`rljob role actor` of a collocated actor pod, run for real with the environment the operator gives the pod, beside
a rollout that fails (RLJOB_TEST_COLLOCATED_ROLLOUT_COMMAND): the process ends with the code the operator acts on.

The pod's names and fixed ports are moved to 127.0.0.1 and free ports, so no network namespace is needed; the
job file is the rendered ConfigMap's. A rollout that cannot be kept running stops the actor before it trains.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.api import validate_job
from rljob.api.loading import parse_documents
from rljob.launch.local import free_ports
from rljob.launch.overrides import apply_overrides
from rljob.operator.manifests import build_children
from rljob.operator.naming import CONFIG_KEY
from rljob.operator.settings import OperatorSettings
from rljob.runtime.roles.collocated import TEST_ROLLOUT_COMMAND_ENV
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, EXIT_ROLLOUT_GAVE_UP, TRANSPORT_KEY_FILE_ENV
from tests.conftest import REPO

pytestmark = pytest.mark.slow

COLLOCATED = ["spec.roles.rollout.collocated=true", "spec.rollout.weightSync.method=ipc"]
LIMIT_S = 240


def actor_pod_env(tmp_path: Path, overrides: list[str]) -> dict[str, str]:
    """The actor container's environment as the operator builds it, on 127.0.0.1 with free ports."""
    document = parse_documents((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())[0]
    job = validate_job(apply_overrides(document.data, [*COLLOCATED, *overrides]))
    job.metadata.namespace = "research"
    children = build_children(job, OperatorSettings())
    (pod,) = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"]["rljob.io/role"] == "actor"]
    config = next(c for c in children if c["kind"] == "ConfigMap")
    config_file = tmp_path / "job.yaml"
    config_file.write_text(config["data"][CONFIG_KEY])
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    key_file = tmp_path / "transport-key"  # the job's Secret, as the operator makes it and the kubelet mounts it
    key_file.write_bytes(secrets.token_hex(32).encode())
    master, sync, metrics, rollout_metrics, data, rollout_data, reward = free_ports(7)
    env.update(
        {
            "RLJOB_CONFIG": str(config_file),  # where the ConfigMap volume would be mounted
            TRANSPORT_KEY_FILE_ENV: str(key_file),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master),
            "RLJOB_SYNC_PORT": str(sync),
            "RLJOB_METRICS_PORT": str(metrics),
            "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT": str(rollout_metrics),
            "RLJOB_ACTOR_ENDPOINTS": f"127.0.0.1:{data}",
            "RLJOB_ROLLOUT_ENDPOINTS": f"127.0.0.1:{rollout_data}",
            "RLJOB_REWARD_ENDPOINTS": f"127.0.0.1:{reward}",
        }
    )
    home = tmp_path / "home"
    home.mkdir()
    env.update({"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    return env


def run_actor(env: dict[str, str], rollout_exits_with: int) -> subprocess.CompletedProcess[str]:
    env = {**env, TEST_ROLLOUT_COMMAND_ENV: f"{sys.executable} -c 'import sys; sys.exit({rollout_exits_with})'"}
    command = [str(Path(sys.executable).parent / "rljob"), "role", "actor"]  # the container's command
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=LIMIT_S)


def test_a_rollout_stopped_on_its_configuration_ends_the_actor_pod_with_78(tmp_path):
    done = run_actor(actor_pod_env(tmp_path, []), EXIT_FATAL_CONFIG)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_FATAL_CONFIG, output[-3000:]
    assert "rollout[0] exited with code 78: stopped on a configuration error" in output


def test_a_rollout_that_fails_under_failjob_ends_the_actor_pod_with_79(tmp_path):
    done = run_actor(actor_pod_env(tmp_path, ["spec.failurePolicy.rollout=FailJob"]), 1)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_ROLLOUT_GAVE_UP, output[-3000:]
    assert (
        "rollout[0] exited with code 1: failed and spec.failurePolicy.rollout is FailJob; stopping the actor, "
        "which exits with code 79" in output
    )
