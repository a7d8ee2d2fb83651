"""Random manifests never crash validation: the answer is a valid job or a list of problems."""

import copy
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rljob.api import InvalidRLJob, load_jobs, validate_job
from tests.conftest import EXAMPLES

BASES = [yaml.safe_load(p.read_text()) for p in EXAMPLES]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, (*prefix, i))
    return found


@st.composite
def mutated_manifests(draw: st.DrawFn) -> Any:
    manifest = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(manifest) if p]
        if not paths:
            return draw(json_values)
        path = draw(st.sampled_from(paths))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(st.text(min_size=1, max_size=10))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
    return manifest


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_manifests())
def test_random_manifest_gives_a_job_or_problems_never_a_crash(manifest: Any):
    try:
        job = validate_job(manifest)
    except InvalidRLJob as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.message and "Traceback" not in problem.message
            str(problem.render("job.yaml"))
    else:
        assert job.api_version == "rljob.io/v1alpha1"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_gives_jobs_or_problems_never_a_crash(text: str):
    try:
        load_jobs(text, "random.yaml")
    except InvalidRLJob as exc:
        assert exc.problems
