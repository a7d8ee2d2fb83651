"""What a vision-language job cannot combine with yet is refused up front, naming the field and the way out."""

from __future__ import annotations

import pytest
import yaml

from rljob.api import InvalidRLJob, validate_job
from tests.conftest import REPO

VLM = yaml.safe_load((REPO / "examples" / "grpo-vlm-tiny-shapes.yaml").read_text())


def with_changes(**spec_changes) -> dict:
    data = yaml.safe_load(yaml.safe_dump(VLM))
    for dotted, value in spec_changes.items():
        node = data["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"model__builtin__architecture": "tiny-qwen2"}, "spec.model.builtin.architecture: the shapes dataset's"),
        (
            {"sft": {"steps": 5, "responseTemplate": "{answer}"}},
            "spec.sft.steps: the supervised warm-up reads text only",
        ),
        ({"task__llm__env": {"builtin": "calculator"}}, "spec.task.llm.env: vision-language jobs are single-turn"),
        ({"task__llm__dataset__minPixels": 5000}, "spec.task.llm.dataset.minPixels: must be at most maxPixels 1024"),
    ],
    ids=["text-model", "warm-up", "text-env", "pixel-bounds"],
)
def test_a_vision_language_job_refuses_what_it_cannot_run_yet(changes, said):
    with pytest.raises(InvalidRLJob) as refused:
        validate_job(with_changes(**changes))
    assert said in str(refused.value)


def test_the_examples_are_accepted():
    validate_job(VLM)
    validate_job(yaml.safe_load((REPO / "examples" / "grpo-qwen2.5-vl-geometry3k.yaml").read_text()))


def test_fsdp2_shards_a_vision_language_policy_when_every_row_has_an_image(tmp_path):
    """The vision tower's shards are gathered collectively: a row without an image would leave one rank's pass
    without the tower and hang the group, so such a dataset is refused where it is read, naming the row."""
    from rljob.runtime.preflight import preflight

    sharded = with_changes(trainer__parallelism="fsdp2", roles__actor__replicas=2)
    assert preflight(validate_job(sharded), load=True) == []
    rows = tmp_path / "rows.jsonl"
    image = tmp_path / "red.png"
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(image)
    rows.write_text(
        '{"prompt": "colour?", "answer": "r", "images": ["red.png"]}\n{"prompt": "count?", "answer": "1"}\n'
    )
    sharded["spec"]["task"]["llm"]["dataset"] = {"path": str(rows), "minPixels": 1024, "maxPixels": 1024}
    (problem,) = preflight(validate_job(sharded), load=True)
    assert problem.path == "spec.trainer.parallelism"
    assert "row 1 of the dataset has no image" in problem.message and "trainer.parallelism: ddp" in problem.message
    sharded["spec"]["trainer"]["parallelism"] = "ddp"
    assert preflight(validate_job(sharded), load=True) == []  # ddp runs text-only rows beside image rows
