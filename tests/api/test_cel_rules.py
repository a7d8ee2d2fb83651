"""The CRD's CEL rules (x-kubernetes-validations) and `rljob validate` agree.

Each cross-field violation below must be caught twice: by the Python rules (with the field path a
user sees) and by a CEL rule the API server evaluates. Every CEL rule in the CRD is exercised.
"""

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import InvalidRLJob, validate_job
from rljob.api.crd import build_crd
from tests.conftest import EXAMPLES, REPO
from tests.k8s_schema import all_rules, apply_defaults, cel_violations

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
GYM = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
LLM = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())


def _set(manifest: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(manifest)
    *parents, leaf = dotted.split(".")
    node = manifest
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return manifest


_DELETE = object()
COLLOCATED = _set(_set(LLM, "spec.roles.rollout.collocated", True), "spec.rollout.weightSync", {"method": "ipc"})

VIOLATIONS = [
    ("gym-with-grpo", GYM, "spec.algorithm.name", "grpo", "spec.algorithm.name"),
    ("grpo-group-size-1", LLM, "spec.algorithm.groupSize", 1, "spec.algorithm.groupSize"),
    ("gym-without-gym-section", GYM, "spec.task.gym", _DELETE, "spec.task.gym"),
    ("llm-with-gym-section", LLM, "spec.task.gym", {"envId": "CartPole-v1"}, "spec.task.gym"),
    ("dataset-two-sources", LLM, "spec.task.llm.dataset.path", "/data/x.jsonl", "spec.task.llm.dataset"),
    ("local-model-without-path", LLM, "spec.model.source", "local", "spec.model.path"),
    ("hub-model-without-id", LLM, "spec.model.source", "hub", "spec.model.hubId"),
    ("job-model-without-name", LLM, "spec.model.source", "job", "spec.model.job"),
    ("job-teacher-without-name", LLM, "spec.algorithm", {"name": "distill", "distill": {"teacher": {"source": "job"}}},
     "spec.algorithm.distill.teacher.job"),
    ("reward-model-path-and-job", LLM, "spec.reward.functions", [{"model": {"path": "rm", "job": "rm"}}],
     "spec.reward.functions[0].model"),
    ("off-policy-inverted", LLM, "spec.algorithm.offPolicy", {"low": 3.0, "high": 2.0}, "spec.algorithm.offPolicy.low"),
    ("reward-builtin-and-module", LLM, "spec.reward.functions", [{"builtin": "format", "module": "r.py:f"}],
     "spec.reward.functions[0]"),
    ("reward-builtin-and-model", LLM, "spec.reward.functions", [{"builtin": "format", "model": {"path": "rm"}}],
     "spec.reward.functions[0]"),
    ("reward-model-and-judge", LLM, "spec.reward.functions",
     [{"model": {"path": "rm"}, "judge": {"path": "j", "rubric": "{response}"}}], "spec.reward.functions[0]"),
    ("judge-path-and-hub-id", LLM, "spec.reward.functions",
     [{"judge": {"path": "j", "hubId": "org/judge", "rubric": "{response}"}}], "spec.reward.functions[0].judge"),
    ("judge-min-score-not-below-max", LLM, "spec.reward.functions",
     [{"judge": {"path": "j", "rubric": "{response}", "minScore": 10, "maxScore": 1}}],
     "spec.reward.functions[0].judge.minScore"),
    ("text-env-builtin-and-module", LLM, "spec.task.llm.env", {"builtin": "calculator", "module": "env.py:Env"},
     "spec.task.llm.env"),
    ("reward-function-without-source", LLM, "spec.reward.functions", [{"weight": 1.0}], "spec.reward.functions[0]"),
    ("gpu-product-without-gpus", GYM, "spec.roles.rollout.placement", {"gpuProduct": "NVIDIA-L40S"},
     "spec.roles.rollout.placement.gpuProduct"),
    ("kueue-without-queue", GYM, "spec.scheduling", {"gang": "kueue"}, "spec.scheduling.queue"),
    ("name-too-long", GYM, "metadata.name", "x" * 48, "metadata.name"),
    ("llm-ppo-with-dynamic-sampling", LLM, "spec.algorithm", {"name": "ppo", "dynamicSampling": True},
     "spec.algorithm.dynamicSampling"),
    ("distill-without-teacher", LLM, "spec.algorithm", {"name": "distill"}, "spec.algorithm.distill"),
    ("distill-section-on-grpo", LLM, "spec.algorithm", {"name": "grpo", "distill": {"teacher": {"path": "/t"}}},
     "spec.algorithm.distill"),
    ("local-teacher-without-path", LLM, "spec.algorithm", {"name": "distill", "distill": {"teacher": {}}},
     "spec.algorithm.distill.teacher.path"),
    ("hub-teacher-without-id", LLM, "spec.algorithm",
     {"name": "distill", "distill": {"teacher": {"source": "hub"}}}, "spec.algorithm.distill.teacher.hubId"),
    ("overlong-buffer-not-below-max-response", LLM, "spec.algorithm.overlong", {"buffer": 4096},
     "spec.algorithm.overlong.buffer"),
    ("autoscale-min-above-max", LLM, "spec.roles.rollout.autoscale", {"minReplicas": 3, "maxReplicas": 2},
     "spec.roles.rollout.autoscale.minReplicas"),
    ("autoscale-on-gym", GYM, "spec.roles.rollout.autoscale", {"maxReplicas": 2}, "spec.roles.rollout.autoscale"),
    ("sft-without-demonstration", LLM, "spec.sft", {"steps": 10}, "spec.sft"),
    ("sft-template-and-turns", LLM, "spec.sft",
     {"steps": 10, "responseTemplate": "calc({expression})", "turns": ["calc({expression})"]}, "spec.sft"),
    ("ipc-without-collocation", LLM, "spec.rollout.weightSync", {"method": "ipc"}, "spec.rollout.weightSync.method"),
    ("collocated-without-ipc", LLM, "spec.roles.rollout.collocated", True, "spec.rollout.weightSync.method"),
    ("collocated-scaled", COLLOCATED, "spec.roles.rollout.replicas", 2, "spec.roles.rollout.replicas"),
    ("gym-more-rollouts-than-envs", GYM, "spec.roles.rollout.replicas", 3, "spec.roles.rollout.replicas"),
    ("tensorboard-tracker-without-dir", GYM, "spec.logging.trackers", [{"name": "tensorboard"}],
     "spec.logging.trackers[0].dir"),
    ("tensorboard-tracker-with-a-secret", GYM, "spec.logging.trackers",
     [{"name": "tensorboard", "dir": "/tb", "apiKeySecret": {"name": "keys", "key": "tb"}}],
     "spec.logging.trackers[0].apiKeySecret"),
]  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_cel_rule_holds_on_the_examples(path: Path):
    manifest = yaml.safe_load(path.read_text())
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, manifest)) == []


@pytest.mark.parametrize(
    ("base", "field", "value", "python_path"),
    [v[1:] for v in VIOLATIONS],
    ids=[v[0] for v in VIOLATIONS],
)
def test_cross_field_violation_is_caught_by_cel_and_by_validate(base, field, value, python_path):
    manifest = _set(base, field, value)
    with pytest.raises(InvalidRLJob) as caught:
        validate_job(manifest)
    assert python_path in [p.path for p in caught.value.problems]
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, manifest)), "no CEL rule caught it"


def test_a_collocated_job_is_valid_for_cel_with_its_one_rollout_replica():
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, COLLOCATED)) == []
    assert cel_violations(SCHEMA, apply_defaults(SCHEMA, _set(COLLOCATED, "spec.roles.rollout.replicas", 1))) == []


def test_every_cel_rule_of_the_crd_is_exercised():
    exercised = set()
    for _, base, field, value, _ in VIOLATIONS:
        manifest = apply_defaults(SCHEMA, _set(base, field, value))
        exercised |= {rule for _, rule, _ in cel_violations(SCHEMA, manifest)}
    declared = {rule for _, rule in all_rules(SCHEMA)}
    assert declared - exercised == set()
