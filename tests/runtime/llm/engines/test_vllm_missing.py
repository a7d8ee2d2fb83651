"""Where vLLM is not installed, a vllm job says so and how to fix it: `rljob run` before any process starts,
the rollout role (in a pod) with the fatal-config exit code. Python's own way to make a package unavailable
(`sys.modules[name] = None`: every import of it fails) stands in for an environment without it."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from rljob.launch.local import free_ports
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, local_identities, ports_needed
from tests.conftest import REPO

WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None; from rljob.cli.main import main; sys.argv[0] = 'rljob'; main()"
SAID = "spec.rollout.engine: vllm is not installed where this rollout runs; install rljob[vllm]"


def vllm_job(tmp_path) -> str:
    job = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    job["spec"]["rollout"]["engine"] = "vllm"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_rljob_run_refuses_a_vllm_job_without_vllm_before_any_role_starts(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, "run", vllm_job(tmp_path), "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert SAID in result.stdout + result.stderr
    assert "or set spec.rollout.engine: hf" in result.stdout + result.stderr
    assert not (out / "logs").exists()


def test_a_vllm_rollout_role_without_vllm_exits_78(tmp_path):
    replicas = {"actor": 1, "rollout": 1, "env": 0, "reward": 1}
    identities = local_identities("novllm", replicas, vllm_job(tmp_path), free_ports(ports_needed(replicas)), "")
    identity = next(i for i in identities if i.role == "rollout")
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, "role", "rollout"],
        env={**os.environ, **identity.to_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_FATAL_CONFIG, result.stdout + result.stderr
    assert SAID in result.stdout + result.stderr
