"""Every pod `rljob render` prints passes the `restricted` Pod Security Standard, for every example and every role
layout (collocated, GPU, fsdp2, vLLM, sandboxed rewards): a namespace that enforces it admits rljob's jobs."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api import InvalidRLJob
from rljob.operator.manifests import build_children
from tests.operator.conftest import EXAMPLES
from tests.operator.pod_security import restricted_violations

LAYOUTS: dict[str, dict[str, Any]] = {
    "as-written": {},
    "gpu": {"spec__roles__actor__gpusPerReplica": 2, "spec__roles__rollout__gpusPerReplica": 1},
    "no-checkpoint-claim": {"spec__checkpoint__storage": {"persistent": False}},
}
LLM_LAYOUTS: dict[str, dict[str, Any]] = {
    "collocated": {
        "spec__roles__rollout__collocated": True,
        "spec__rollout__weightSync__method": "ipc",
        "spec__roles__actor__replicas": 1,
        "spec__roles__rollout__replicas": 1,
    },
    "fsdp2": {"spec__trainer__parallelism": "fsdp2", "spec__roles__actor__replicas": 2},
    "vllm": {"spec__rollout__engine": "vllm"},
    "filesystem-weights": {"spec__rollout__weightSync__method": "filesystem"},
}


def cases() -> list[Any]:
    out = []
    for path in EXAMPLES:
        for layout in LAYOUTS:
            out.append(pytest.param(path.stem, layout, id=f"{path.stem}-{layout}"))
        for layout in LLM_LAYOUTS:
            out.append(pytest.param(path.stem, layout, id=f"{path.stem}-{layout}"))
    return out


@pytest.mark.parametrize(("example", "layout"), cases())
def test_every_pod_passes_the_restricted_profile(example, layout, example_documents, job_from, settings):
    document = example_documents[example]
    if layout in LLM_LAYOUTS and document["spec"]["task"]["type"] != "llm":
        pytest.skip("an llm layout")
    try:
        job = job_from(document, **{**LAYOUTS, **LLM_LAYOUTS}[layout])
    except InvalidRLJob as exc:
        pytest.skip(f"not a valid layout of this example: {exc}")  # test_every_layout_is_checked_somewhere
    pods = [c for c in build_children(job, settings) if c["kind"] == "Pod"]
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == [], pod["metadata"]["name"]


def test_every_layout_is_checked_somewhere(example_documents, job_from):
    for layout, changes in {**LAYOUTS, **LLM_LAYOUTS}.items():
        valid = 0
        for path in EXAMPLES:
            try:
                job_from(example_documents[path.stem], **changes)
                valid += 1
            except InvalidRLJob:
                continue
        assert valid, f"no example takes the {layout} layout"


def test_the_checker_refuses_what_the_restricted_profile_refuses(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    pod = next(c for c in build_children(job, settings) if c["kind"] == "Pod")
    container = pod["spec"]["containers"][0]
    container["securityContext"]["allowPrivilegeEscalation"] = True
    container["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    del pod["spec"]["securityContext"]["seccompProfile"]
    found = restricted_violations(pod)
    for what in ("allowPrivilegeEscalation", "SYS_ADMIN", "host namespaces", "hostPath", "seccompProfile", "drop ALL"):
        assert any(what in line for line in found), (what, found)
