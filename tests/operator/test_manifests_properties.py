"""Property: any valid RLJob (an example mutated within the API's bounds) builds manifests a real API
server accepts, or is refused with an InvalidRLJob naming fields; the builders never crash."""

from __future__ import annotations

import copy
import json
import string
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rljob.api import ROLE_NAMES, InvalidRLJob, validate_job
from rljob.api.spec import OFFLINE_STAGES
from rljob.operator.manifests import build_children, replica_counts
from rljob.operator.settings import OperatorSettings

PRODUCTS = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L40S", "NVIDIA-A100-SXM4-80GB", "Tesla-T4"]

dns_label = st.from_regex(r"\A[a-z]([-a-z0-9]{0,10}[a-z0-9])?\Z")
label_value = st.from_regex(r"\A[A-Za-z0-9]([-A-Za-z0-9_.]{0,12}[A-Za-z0-9])?\Z")
label_key = st.builds(lambda p, n: f"{p}/{n}" if p else n, st.sampled_from(["", "example.com", "node.io"]), dns_label)
abs_path = st.lists(dns_label, min_size=1, max_size=3).map(lambda parts: "/" + "/".join(parts))
env_name = st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,15}\Z").filter(lambda n: not n.startswith("RLJOB_"))
quantity = st.one_of(
    st.integers(1, 64),
    st.sampled_from(["500m", "1", "2.5", "4Gi", "512Mi", "100G"]),
)


@st.composite
def role_patch(draw: st.DrawFn, role: str, base: dict[str, Any]) -> dict[str, Any]:
    gym = base["spec"]["task"]["type"] == "gym"
    patch: dict[str, Any] = {}
    if role == "actor":
        patch["replicas"] = draw(st.integers(1, 3))
    elif role == "rollout":
        patch["replicas"] = draw(st.integers(0, 3))
    elif role == "env":
        patch["replicas"] = draw(st.integers(1, 3)) if gym else draw(st.integers(0, 2))
    else:
        patch["replicas"] = draw(st.integers(0, 2))
    gpus = draw(st.sampled_from([0, 0, 1, 2, 8]))
    patch["gpusPerReplica"] = gpus
    placement: dict[str, Any] = {}
    if gpus and draw(st.booleans()):
        placement["gpuProduct"] = draw(st.sampled_from(PRODUCTS))
    placement["nodeSelector"] = draw(st.dictionaries(label_key, label_value, max_size=2))
    placement["tolerations"] = draw(
        st.lists(
            st.one_of(
                st.builds(lambda k: {"key": k, "operator": "Exists"}, label_key),
                st.builds(
                    lambda k, v, e: {"key": k, "operator": "Equal", "value": v, "effect": e},
                    label_key,
                    label_value,
                    st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                ),
                st.just({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}),
            ),
            max_size=2,
        )
    )
    if draw(st.booleans()):
        placement["priorityClassName"] = draw(dns_label)
    if draw(st.booleans()):
        expressions = st.lists(
            st.builds(
                lambda k, v: {"key": k, "operator": "In", "values": [v]},
                label_key,
                label_value,
            ),
            min_size=1,
            max_size=2,
        )
        terms = draw(st.lists(expressions.map(lambda e: {"matchExpressions": e}), min_size=1, max_size=2))
        placement["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
        }
    patch["placement"] = placement
    patch["resources"] = {
        "requests": draw(st.dictionaries(st.sampled_from(["cpu", "memory"]), quantity, max_size=2)),
        "limits": draw(st.dictionaries(st.sampled_from(["cpu", "memory"]), quantity, max_size=2)),
    }
    patch["env"] = [
        {"name": name, "value": value}
        for name, value in draw(st.dictionaries(env_name, st.text(string.printable, max_size=8), max_size=3)).items()
        if name not in {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"}
    ]
    paths = draw(
        st.lists(abs_path, max_size=2, unique=True).filter(lambda ps: not any(p.startswith("/etc") for p in ps))
    )
    patch["volumes"] = [{"name": f"vol-{i}", "emptyDir": {}} for i in range(len(paths))]
    patch["volumeMounts"] = [{"name": f"vol-{i}", "mountPath": p} for i, p in enumerate(paths)]
    if draw(st.booleans()):
        patch["image"] = draw(st.sampled_from(["registry.local/rl:1", "busybox@sha256:" + "a" * 64]))
    return patch


@st.composite
def valid_jobs(draw: st.DrawFn, bases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = bases[draw(st.sampled_from(sorted(bases)))]
    data = copy.deepcopy(base)
    data["metadata"] = {"name": draw(st.from_regex(r"\A[a-z]([-a-z0-9]{0,45}[a-z0-9])?\Z"))}
    if draw(st.booleans()):
        data["metadata"]["namespace"] = draw(dns_label)
    if draw(st.booleans()):
        data["metadata"]["uid"] = str(draw(st.uuids()))
    spec = data["spec"]
    roles = spec.setdefault("roles", {})
    for role in ROLE_NAMES:
        roles[role] = draw(role_patch(role, base))
    # Replica counts the validation rules allow for the base's kind of job, so that most drawn jobs are valid.
    if spec["task"]["type"] == "gym":  # the environments give the reward; a rollout drives at least one env replica
        roles["reward"]["replicas"] = 0
        roles["rollout"]["replicas"] = draw(st.integers(1, roles["env"]["replicas"]))
    else:
        if not spec["task"]["llm"].get("env"):
            roles["env"]["replicas"] = 0
        else:  # a text environment is served by the env role
            roles["env"]["replicas"] = draw(st.integers(1, 2))
        if spec["algorithm"]["name"] in OFFLINE_STAGES:  # the actor alone
            roles["rollout"]["replicas"] = roles["reward"]["replicas"] = 0
    if spec["task"]["type"] == "gym":
        spec["task"]["gym"]["numEnvs"] = 8
    gang = draw(st.sampled_from(["none", "volcano", "scheduler-plugins", "kueue"]))
    scheduling: dict[str, Any] = {"gang": gang}
    if gang == "kueue" or (gang == "volcano" and draw(st.booleans())):
        scheduling["queue"] = draw(dns_label)
    if draw(st.booleans()):
        scheduling["schedulerName"] = draw(dns_label)
    spec["scheduling"] = scheduling
    spec["logging"] = {"prometheusPort": draw(st.integers(1024, 65535))}
    checkpoint = {"interval": 10}
    if draw(st.booleans()):
        checkpoint["dir"] = draw(abs_path)
    if draw(st.booleans()):
        checkpoint["volumeClaim"] = draw(dns_label)
    spec["checkpoint"] = checkpoint
    return data


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_valid_job_builds_manifests_an_api_server_accepts(data, example_documents, validate_manifest):
    document = data.draw(valid_jobs(example_documents), label="job")
    try:
        job = validate_job(document)
    except InvalidRLJob:
        assume(False)
    try:
        children = build_children(job, OperatorSettings())
    except InvalidRLJob as refused:
        # Only clashes with what rljob adds (see manifests/checks.py), each naming a spec field.
        assert refused.problems and all(p.path.startswith("spec.") and p.message for p in refused.problems)
        return
    json.dumps(children)  # what goes over the wire
    pods = [c for c in children if c["kind"] == "Pod"]
    assert len(pods) == sum(replica_counts(job).values())
    for group in (c for c in children if c["kind"] == "PodGroup"):
        assert group["spec"]["minMember"] == len(pods)
    assert len({c["metadata"]["name"] for c in pods}) == len(pods)
    for manifest in children:
        validate_manifest(manifest)
    for pod in pods:
        rs = job.spec.roles.get(pod["metadata"]["labels"]["rljob.io/role"])
        limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == rs.gpus_per_replica
        if rs.placement.gpu_product:
            terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            for term in terms["nodeSelectorTerms"]:
                assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": [rs.placement.gpu_product]} in (
                    term["matchExpressions"]
                )
