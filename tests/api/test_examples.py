"""The shipped examples are valid, and resolving defaults is stable."""

from pathlib import Path

import pytest
import yaml

from rljob.api import load_job_file, validate_job
from tests.conftest import EXAMPLES


def test_every_example_is_shipped():
    names = {p.name for p in EXAMPLES}
    assert {"cartpole-ppo.yaml", "grpo-tiny-arithmetic.yaml", "grpo-qwen-math-h100.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates(path: Path):
    job = load_job_file(path)
    assert job.spec.algorithm.group_size is not None
    assert job.spec.rollout.engine is not None


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_resolved_job_is_a_fixed_point(path: Path):
    """Rendering a resolved job and validating it again changes nothing (what the operator stores)."""
    job = load_job_file(path)
    dumped = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    again = validate_job(yaml.safe_load(yaml.safe_dump(dumped)))
    assert again == job


def test_task_dependent_defaults_are_filled():
    gym = load_job_file(Path("examples/cartpole-ppo.yaml"))
    assert (gym.spec.algorithm.group_size, gym.spec.rollout.engine) == (1, "torch")
    assert gym.spec.roles.reward.replicas == 0
    assert gym.spec.model.builtin.architecture == "mlp"
    llm = load_job_file(Path("examples/grpo-tiny-arithmetic.yaml"))
    assert llm.spec.roles.env.replicas == 0 and llm.spec.roles.reward.replicas == 1
    assert llm.spec.model.builtin.architecture == "tiny-qwen2"
    assert llm.spec.rollout.max_tokens == llm.spec.task.llm.max_response_length == 2


@pytest.mark.parametrize(("name", "expected"), [("dapo", True), ("cispo", True), ("grpo", False), ("gspo", False)])
def test_dynamic_sampling_and_overlong_shaping_default_to_on_for_dapo_and_cispo_only(name: str, expected: bool):
    manifest = yaml.safe_load(Path("examples/grpo-tiny-arithmetic.yaml").read_text())
    manifest["spec"]["algorithm"]["name"] = name
    job = validate_job(manifest)
    assert job.spec.algorithm.dynamic_sampling is expected
    assert job.spec.algorithm.max_sampling_rounds == 4 and (job.spec.algorithm.overlong is not None) is expected
    manifest["spec"]["algorithm"]["dynamicSampling"] = not expected  # an explicit choice is kept
    assert validate_job(manifest).spec.algorithm.dynamic_sampling is (not expected)
    assert load_job_file(Path("examples/cartpole-ppo.yaml")).spec.algorithm.dynamic_sampling is False


def test_h100_example_places_actors_and_rollouts_on_different_gpus():
    job = load_job_file(Path("examples/grpo-qwen-math-h100.yaml"))
    actor, rollout = job.spec.roles.actor, job.spec.roles.rollout
    assert (actor.replicas, actor.gpus_per_replica, actor.placement.gpu_product) == (2, 8, "NVIDIA-H100-80GB-HBM3")
    assert (rollout.replicas, rollout.gpus_per_replica, rollout.placement.gpu_product) == (4, 1, "NVIDIA-L40S")
    assert job.spec.scheduling.gang == "volcano"
    assert job.spec.checkpoint.volume_claim


def test_every_rljob_in_the_readme_and_the_docs_is_a_valid_job(repo: Path):
    pages = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    blocks = [
        block.split("\n", 1)[1]
        for page in pages
        for block in page.read_text(encoding="utf-8").split("```")[1::2]
        # A top-level RLJob, not an HPA whose scaleTargetRef names one.
        if block.startswith("yaml") and "\nkind: RLJob\n" in block
    ]
    names = {validate_job(yaml.safe_load(block)).name for block in blocks}
    assert "cartpole-ppo" in names  # the annotated job of docs/getting-started.md


@pytest.mark.parametrize(("gpus", "explicit", "expected"), [(0, None, 1), (4, None, 4), (4, 2, 2)])
def test_vllm_tensor_parallel_size_defaults_to_the_rollout_pods_gpus(gpus: int, explicit: int | None, expected: int):
    manifest = yaml.safe_load(Path("examples/grpo-tiny-arithmetic.yaml").read_text())
    manifest["spec"]["roles"]["rollout"]["gpusPerReplica"] = gpus
    if explicit is not None:
        manifest["spec"]["rollout"].setdefault("vllm", {})["tensorParallelSize"] = explicit
    assert validate_job(manifest).spec.rollout.vllm.tensor_parallel_size == expected


def test_a_collocated_vllm_engine_defaults_to_sharding_over_the_actors_gpus():
    manifest = yaml.safe_load(Path("examples/grpo-tiny-arithmetic.yaml").read_text())
    manifest["spec"]["roles"]["actor"]["gpusPerReplica"] = 2
    manifest["spec"]["roles"]["rollout"]["collocated"] = True
    manifest["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    assert validate_job(manifest).spec.rollout.vllm.tensor_parallel_size == 2
