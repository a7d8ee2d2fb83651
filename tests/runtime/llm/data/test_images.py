"""Images in prompt rows: every form EasyR1 and Hugging Face datasets use reads, a bad one is named by its row and
column before anything starts, and a bad row met during training is skipped, not fatal."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from rljob.api.spec import DatasetSpec
from rljob.cli.main import app
from rljob.runtime.llm.data.images import (
    ImageError,
    VisionInputs,
    check_images,
    decode_image,
    fit_pixels,
    row_images,
)
from rljob.runtime.llm.data.rows import shapes_rows
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "grpo-vlm-tiny-shapes.yaml"


def png(colour: str = "red", size: tuple[int, int] = (20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def dataset(**fields) -> DatasetSpec:
    return DatasetSpec(path="rows.jsonl", min_pixels=1, max_pixels=10**6, **fields)


def test_every_image_form_of_a_row_decodes_to_the_same_picture(tmp_path):
    data = png()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(data)
    forms = [
        "pics/a.png",  # relative to the dataset file's directory
        str(tmp_path / "pics" / "a.png"),  # absolute: a mounted volume
        data,  # a Parquet binary column
        {"bytes": data, "path": None},  # a Hugging Face Image feature
        {"bytes": None, "path": "pics/a.png"},
        "data:image/png;base64," + base64.b64encode(data).decode(),
        Image.open(io.BytesIO(data)),
    ]
    for form in forms:
        image = decode_image(form, tmp_path, "row 0's images[0]")
        assert image.size == (20, 10) and image.getpixel((3, 3)) == (255, 0, 0), form


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("missing.png", "row 7's images[1] is {dir}/missing.png, which does not exist"),
        ("https://example.org/cat.png", "row 7's images[1] is a remote URL"),
        ("data:image/png;base64,@@@", "row 7's images[1] is a data: URI whose base64 does not decode"),
        (b"not an image", "row 7's images[1] (12 bytes) is not a readable image"),
        (3.5, "row 7's images[1] is float"),
    ],
    ids=["missing-file", "remote-url", "bad-base64", "not-an-image", "wrong-type"],
)
def test_a_bad_image_is_named_by_its_row_and_column(tmp_path, value, said):
    with pytest.raises(ImageError) as refused:
        row_images({"images": [png(), value]}, 7, dataset(), tmp_path)
    assert said.format(dir=tmp_path) in str(refused.value)
    assert str(refused.value).startswith("spec.task.llm.dataset: ")


def test_an_image_column_holds_one_image_or_a_list_and_image_is_found_without_configuration(tmp_path):
    assert len(row_images({"images": png()}, 0, dataset(), tmp_path)) == 1
    assert len(row_images({"image": png()}, 0, dataset(), tmp_path)) == 1
    assert len(row_images({"pictures": [png(), png()]}, 0, dataset(image_key="pictures"), tmp_path)) == 2
    assert row_images({"prompt": "text only"}, 0, dataset(), tmp_path) == []


def test_images_are_scaled_into_the_pixel_bounds_keeping_their_aspect():
    small, large = Image.new("RGB", (10, 20)), Image.new("RGB", (400, 100))
    assert fit_pixels(small, 800, 10**6).size == (20, 40)
    assert fit_pixels(large, 1, 10_000).size == (200, 50)
    assert fit_pixels(small, 100, 300) is small


def test_check_images_reads_headers_and_names_the_first_bad_row(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    rows = [{"images": ["ok.png"]}, {"images": ["ok.png", "broken.png"]}]
    with pytest.raises(ImageError, match=r"row 1's images\[1\] \(.*broken.png\) is not a readable image"):
        check_images(rows, dataset(), tmp_path)
    check_images(rows[:1], dataset(), tmp_path)


def test_validate_load_and_run_refuse_a_dataset_with_a_missing_image_naming_the_row(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    rows = [{"prompt": "colour?", "answer": "r", "images": ["ok.png"]} for _ in range(5)]
    rows[3]["images"] = ["gone.png"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"]["task"]["llm"]["dataset"] = {"path": str(tmp_path / "rows.jsonl"), "minPixels": 1}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    for command in (["validate", "--load"], ["run", "--out", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, [*command, str(tmp_path / "job.yaml")])
        assert result.exit_code == 1, result.output
        assert "row 3's images[0] is " in result.output and "gone.png, which does not exist" in result.output
    assert not (tmp_path / "out").exists()


def test_the_shapes_dataset_is_drawn_from_the_seed_and_its_answers_need_the_image():
    rows = shapes_rows(300, seed=4)
    assert [r["answer"] for r in rows] == [r["answer"] for r in shapes_rows(300, seed=4)]
    assert rows[0]["images"][0].tobytes() == shapes_rows(300, seed=4)[0]["images"][0].tobytes()
    by_question = {q: {r["answer"] for r in rows if r["prompt"] == q} for q in ("colour?", "count?")}
    assert by_question == {"colour?": {"r", "g", "b"}, "count?": {"1", "2", "3"}}
    for row in rows:
        image = row["images"][0]
        coloured = {tuple(p) for p in np.asarray(image).reshape(-1, 3).tolist() if tuple(p) != (255, 255, 255)}
        if row["prompt"] == "colour?":  # the shape's colour is the answer
            assert coloured and all(p[{"r": 0, "g": 1, "b": 2}[row["answer"]]] == max(p) for p in coloured)


def test_vision_inputs_of_several_prompts_concatenate_in_order_and_skip_text_only_ones():
    a = VisionInputs(np.ones((4, 3), np.float32), np.array([[1, 2, 2]]))
    b = VisionInputs(np.zeros((8, 3), np.float32), np.array([[1, 2, 4]]))
    both = VisionInputs.concat([a, None, b])
    assert (
        both is not None
        and both.pixel_values.shape == (12, 3)
        and both.image_grid_thw.tolist()
        == [
            [1, 2, 2],
            [1, 2, 4],
        ]
    )
    assert VisionInputs.concat([None, None]) is None
    wired = VisionInputs.from_wire({"x": 1, **both.to_wire()})
    assert wired is not None and (wired.pixel_values == both.pixel_values).all()
    assert VisionInputs.from_wire({"prompts": []}) is None


def test_a_row_whose_images_do_not_match_its_placeholders_is_refused(tmp_path):
    from rljob.api import load_job_file
    from rljob.runtime.llm.data.prompts import PromptEncoder
    from rljob.runtime.llm.data.rows import load_rows
    from rljob.runtime.llm.models.policy import load_policy

    job = load_job_file(EXAMPLE)
    task = job.spec.task.llm
    rows = load_rows(task, 0)[:4]
    import torch

    _, tokenizer = load_policy(job.spec.model, task, rows, 0, torch.device("cpu"))
    encoder = PromptEncoder(task, tokenizer, Path(tmp_path))
    ids, vision = encoder.encode(rows[0], 0)  # no placeholder: the image goes first, 4 image tokens
    assert vision is not None and vision.image_grid_thw.tolist() == [[1, 4, 4]]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_token) == 4 and ids.index(image_token) < 3
    twice = {**rows[0], "prompt": "<image> and <image>?"}
    with pytest.raises(ImageError, match=r"row 9 has 1 image\(s\) but its prompt has 2 <image> placeholder"):
        encoder.encode(twice, 9)
