"""The builtin cnn's settings in the spec: accepted for gym tasks, one kernel size and stride per convolution."""

from __future__ import annotations

import pytest
import yaml

from rljob.api import InvalidRLJob, validate_job
from rljob.api.view import shown
from tests.conftest import REPO

MINIGRID = yaml.safe_load((REPO / "examples" / "minigrid-pixels-ppo.yaml").read_text())


def with_builtin(**changes) -> dict:
    data = yaml.safe_load(yaml.safe_dump(MINIGRID))
    data["spec"]["model"]["builtin"].update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"strides": [2]}, "spec.model.builtin.strides: needs one entry per convolution: 2 like"),
        ({"kernelSizes": [4, 3, 3]}, "spec.model.builtin.kernelSizes: needs one entry per convolution: 2 like"),
        ({"architecture": "tiny-qwen2"}, "spec.model.builtin.architecture: gym tasks use mlp or cnn"),
    ],
)
def test_cnn_layers_that_do_not_line_up_are_refused_naming_the_field(changes, said):
    with pytest.raises(InvalidRLJob) as refused:
        validate_job(with_builtin(**changes))
    assert said in str(refused.value)


def test_render_shows_the_cnn_settings_and_hides_them_for_the_mlp():
    cnn = shown(validate_job(MINIGRID))["spec"]["model"]["builtin"]
    assert cnn["channels"] == [16, 32] and cnn["kernelSizes"] == [4, 3] and cnn["strides"] == [2, 2]
    mlp = shown(validate_job(with_builtin(architecture="mlp")))["spec"]["model"]["builtin"]
    assert "channels" not in mlp and "strides" not in mlp
