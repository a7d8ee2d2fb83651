"""The pods the operator builds for the tiny vision-language example, run as the kubelet would, each on a host of
its own: the images cross from the actor's host to the rollout's inside the generate requests, and the trainer
reads what the engine generated from. (Whether it learns: the 600-step runs in docs/guides/vision-language.md.)"""

from __future__ import annotations

import json

import pytest

from rljob.operator.manifests import build_children
from rljob.operator.naming import CONFIG_KEY
from rljob.operator.settings import OperatorSettings
from tests.multihost.conftest import load_example
from tests.multihost.kubelet import Kubelet
from tests.multihost.lab import NetnsLab

pytestmark = pytest.mark.slow

STEPS = 4
SHORT = [
    f"spec.trainer.steps={STEPS}",
    "spec.trainer.batchSize=8",
    "spec.evaluation.interval=2",
    "spec.evaluation.size=16",
    "spec.checkpoint.interval=2",
    "spec.logging.tensorboard=false",
]


def test_the_vision_language_example_trains_in_its_pods_each_on_a_host_of_its_own(tmp_path):
    job = load_example("grpo-vlm-tiny-shapes.yaml", [*SHORT, f"spec.checkpoint.dir={tmp_path / 'ckpt'}"])
    job.metadata.namespace = "research"
    children = build_children(job, OperatorSettings())
    pods = {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}
    name = job.name
    assert sorted(pods) == [f"{name}-actor-0", f"{name}-reward-0", f"{name}-rollout-0"]
    config = next(c for c in children if c["kind"] == "ConfigMap")
    config_file = tmp_path / "job.yaml"
    config_file.write_text(config["data"][CONFIG_KEY])
    (tmp_path / "home").mkdir()

    with NetnsLab(name, {"actor": 1, "rollout": 1, "reward": 1}, dns="answering") as lab:
        # A run directory only so that the test reads the actor's metrics.jsonl (a pod reports them on /metrics).
        kubelet = Kubelet(lab, config_file, tmp_path / "home", {"RLJOB_RUN_DIR": str(tmp_path / "run")})
        actor = kubelet.run_until_done(pods, f"{name}-actor-0")
    lines = kubelet.output()
    text = "\n".join(lines[-60:])
    assert actor.returncode == 0, text
    actor_lines = [line for line in lines if line.startswith(f"{name}-actor-0 | ")]
    assert any(f" step {STEPS}/{STEPS} reward " in line for line in actor_lines), text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:  # the rollout on its own host generated from the very images the trainer reads
        assert record["mismatch_max_gap"] < 1e-4 and record["prompts_skipped_images"] == 0
    assert [r["eval_prompts"] for r in records if "eval_prompts" in r] == [16, 16]
    assert (tmp_path / "ckpt" / "hf-latest" / "preprocessor_config.json").is_file()
