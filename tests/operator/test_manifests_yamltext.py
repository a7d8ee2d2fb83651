"""The ConfigMap's YAML writer (rljob/operator/manifests/yamltext.py): any plain data reads back as it was."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob.operator.manifests.config import resolved_job_document, resolved_job_yaml
from rljob.operator.manifests.yamltext import dump

TRICKY = [
    "",
    "yes",
    "No",
    "ON",
    "null",
    "~",
    "1e3",
    "0x1f",
    "1_000",
    "12:30",
    "2026-11-29",
    ".inf",
    "- a",
    "a: b",
    "#x",
    "x #y",
    " lead",
    "trail ",
    "a\nb",
    "tab\tin",
    'q"uote',
    "back\\slash",
    "é ü 日本",
    "😀",
    "\x85",
    "\u2028",
    "\x7f",
    "=",
    "<<",
    "!tag",
    "&a",
    "*a",
    "%",
    "@",
    "`",
    "|",
    ">",
    "{}",
    "[]",
    "'",
    ",",
    "?",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.sampled_from(TRICKY),
)
data = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text() | st.sampled_from(TRICKY), inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(data)
def test_any_plain_data_reads_back_as_it_was(value) -> None:
    assert yaml.safe_load(dump(value)) == value


@pytest.mark.parametrize("value", [1e-05, 1e16, -2.5e-07, 1e300, float("inf"), float("-inf"), 0.1, -0.0])
def test_floats_stay_floats(value: float) -> None:
    back = yaml.safe_load(dump({"x": value}))["x"]
    assert isinstance(back, float) and back == value


def test_nan_stays_nan() -> None:
    assert math.isnan(yaml.safe_load(dump([float("nan")]))[0])


def test_words_a_reader_would_take_for_something_else_are_quoted_and_names_are_not() -> None:
    text = dump({"name": "cartpole-ppo", "env": "CartPole-v1", "model": "Qwen/Qwen2.5-7B", "flag": "yes"})
    assert text == 'name: cartpole-ppo\nenv: CartPole-v1\nmodel: Qwen/Qwen2.5-7B\nflag: "yes"\n'


def test_what_is_not_plain_data_is_refused() -> None:
    with pytest.raises(TypeError, match="not plain data: set"):
        dump({"x": {1, 2}})
    with pytest.raises(TypeError, match="mapping keys must be strings"):
        dump({1: "x"})


def test_every_example_job_reads_back_from_its_config_map(example_documents) -> None:
    from rljob.api import RLJob

    for name, document in example_documents.items():
        job = RLJob.model_validate(document)
        assert yaml.safe_load(resolved_job_yaml(job)) == resolved_job_document(job), name
