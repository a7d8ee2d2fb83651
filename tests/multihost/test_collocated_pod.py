"""The pods the operator builds for a collocated job, run as the kubelet would: each pod's container command with
its env, on a host named after the pod (tests/multihost/lab.py), the job file from the rendered ConfigMap.

The actor pod's process starts the rollout beside it (rljob/runtime/roles/collocated.py) at `<job>-actor-0.<job>`,
the name every pod of the job is given for it; the reward pod is a host of its own. A rollout killed mid-run
is covered by tests/runtime/roles/test_collocated.py with a trivial child: here it would cost a minute, the actor's
`wake` request to the dead rollout waiting out its reply timeout (SYNC_REPLY_TIMEOUT_S) before the new one is
synced.
"""

from __future__ import annotations

import re

import pytest

from rljob.operator.manifests import build_children
from rljob.operator.naming import CONFIG_KEY
from rljob.operator.settings import OperatorSettings
from tests.multihost.conftest import load_example
from tests.multihost.kubelet import Kubelet
from tests.multihost.lab import NetnsLab

pytestmark = pytest.mark.slow

STEPS = 16
COLLOCATED = ["spec.roles.rollout.collocated=true", "spec.rollout.weightSync.method=ipc"]
SHORT = [f"spec.trainer.steps={STEPS}", "spec.trainer.batchSize=16", "spec.logging.tensorboard=false"]


def test_the_collocated_actor_pod_trains_with_the_rollout_beside_it(tmp_path):
    job = load_example("grpo-tiny-arithmetic.yaml", [*COLLOCATED, *SHORT, f"spec.checkpoint.dir={tmp_path / 'ckpt'}"])
    job.metadata.namespace = "research"
    children = build_children(job, OperatorSettings())
    pods = {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}
    assert sorted(pods) == ["grpo-tiny-arithmetic-actor-0", "grpo-tiny-arithmetic-reward-0"]
    config = next(c for c in children if c["kind"] == "ConfigMap")
    config_file = tmp_path / "job.yaml"
    config_file.write_text(config["data"][CONFIG_KEY])
    (tmp_path / "home").mkdir()

    with NetnsLab(job.name, {"actor": 1, "reward": 1}, dns="answering") as lab:
        kubelet = Kubelet(lab, config_file, tmp_path / "home")
        actor = kubelet.run_until_done(pods, "grpo-tiny-arithmetic-actor-0")
    lines = kubelet.output()
    text = "\n".join(lines[-60:])
    assert actor.returncode == 0, text
    actor_lines = [line for line in lines if line.startswith("grpo-tiny-arithmetic-actor-0 | ")]
    # Both processes of the pod print to its one output, each line telling whose it is.
    assert any("INFO actor[0] training" in line for line in actor_lines), text
    assert any(
        "rollout[0] | " in line and "INFO rollout[0] generating with the hf engine" in line for line in actor_lines
    )
    assert any(re.search(r"rollout\[0\] started beside the actor \(pid \d+\)$", line) for line in actor_lines)
    # The actor put its rollout to sleep to train, and trained every step.
    assert any(
        "rollout[0] | " in line and "collocated: the engine sleeps while the actor trains" in line
        for line in actor_lines
    )
    assert any(f" step {STEPS}/{STEPS} reward " in line for line in actor_lines), text
    # Ended with the actor, as the pod's container would: no rollout line is left unprefixed.
    assert any("rollout[0] | " in line and "received SIGTERM, stopping" in line for line in actor_lines), text
    assert not any("INFO rollout[0]" in line and "rollout[0] | " not in line for line in lines)
