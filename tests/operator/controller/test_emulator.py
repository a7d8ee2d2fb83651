"""The API stand-in behaves like a real server where the operator depends on it."""

from __future__ import annotations

import asyncio
import json

import kmock
import pytest

from tests.operator.controller.conftest import PODS, RLJOBS, cartpole_job, new_emulator
from tests.operator.controller.emulator import LIMIT_RANGES, RESOURCE_QUOTAS, KubernetesApiEmulator

JOBS_URL = "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs"
PODS_URL = "/api/v1/namespaces/ns/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


def pod(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {}}


async def test_create_fills_server_metadata_and_rejects_duplicates(kube: KubernetesApiEmulator) -> None:
    resp = await kube.post(PODS_URL, json=pod("a"))
    created = await resp.json()
    meta = created["metadata"]
    assert meta["namespace"] == "ns"
    assert meta["uid"] and meta["creationTimestamp"] and meta["resourceVersion"]
    assert meta["generation"] == 1
    again = await kube.post(PODS_URL, json=pod("a"))
    assert again.status == 409
    assert (await again.json())["reason"] == "AlreadyExists"
    generated = await (await kube.post(PODS_URL, json={"metadata": {"generateName": "job-"}})).json()
    assert generated["metadata"]["name"].startswith("job-") and len(generated["metadata"]["name"]) == 9


async def test_stale_resource_version_conflicts_and_failed_patch_test_is_invalid(kube: KubernetesApiEmulator) -> None:
    created = await (await kube.post(PODS_URL, json=pod("a"))).json()
    rv = created["metadata"]["resourceVersion"]
    ok = await kube.patch(
        f"{PODS_URL}/a", json={"metadata": {"resourceVersion": rv, "labels": {"x": "1"}}}, headers=MERGE
    )
    assert ok.status == 200
    assert int((await ok.json())["metadata"]["resourceVersion"]) > int(rv)
    stale = await kube.patch(f"{PODS_URL}/a", json={"metadata": {"resourceVersion": rv}}, headers=MERGE)
    assert stale.status == 409
    test_op = [{"op": "test", "path": "/metadata/labels/x", "value": "2"}]
    failed = await kube.patch(f"{PODS_URL}/a", data=json.dumps(test_op), headers=JSON_PATCH)
    assert failed.status == 422


async def test_status_is_isolated_from_the_object_and_spec_changes_bump_generation(
    kube: KubernetesApiEmulator,
) -> None:
    job = cartpole_job("j")
    created = await (await kube.post(JOBS_URL, json=dict(job, status={"phase": "Running"}))).json()
    assert "status" not in created
    main = await (await kube.patch(f"{JOBS_URL}/j", json={"status": {"phase": "X"}, "spec": {"suspend": True}})).json()
    assert "status" not in main and main["metadata"]["generation"] == 2
    status = await (await kube.patch(f"{JOBS_URL}/j/status", json={"status": {"phase": "Running"}, "spec": {}})).json()
    assert status["status"]["phase"] == "Running" and status["spec"] == main["spec"] and main["spec"]["suspend"]
    assert status["metadata"]["generation"] == 2


async def test_scale_subresource_writes_the_rollout_replicas(kube: KubernetesApiEmulator) -> None:
    await kube.post(JOBS_URL, json=cartpole_job("j"))
    scaled = await (await kube.patch(f"{JOBS_URL}/j/scale", json={"spec": {"replicas": 3}})).json()
    assert scaled["spec"]["replicas"] == 3
    assert kube.read_object(RLJOBS, "ns", "j")["spec"]["roles"]["rollout"]["replicas"] == 3


async def test_label_selectors_filter_lists(kube: KubernetesApiEmulator) -> None:
    for name, role in (("a", "actor"), ("b", "rollout"), ("c", "env")):
        await kube.post(PODS_URL, json=pod(name, job="j", role=role))
    await kube.post(PODS_URL, json=pod("d"))

    async def names(selector: str) -> list[str]:
        listed = await (await kube.get(PODS_URL, params={"labelSelector": selector})).json()
        return sorted(item["metadata"]["name"] for item in listed["items"])

    assert await names("job=j") == ["a", "b", "c"]
    assert await names("job=j,role!=actor") == ["b", "c"]
    assert await names("role in (actor, env)") == ["a", "c"]
    assert await names("!job") == ["d"]


async def test_watch_resumes_from_a_version_and_answers_410_after_compaction(kube: KubernetesApiEmulator) -> None:
    first = await (await kube.post(PODS_URL, json=pod("a"))).json()
    await kube.post(PODS_URL, json=pod("b"))
    since = first["metadata"]["resourceVersion"]
    async with kube.get(PODS_URL, params={"watch": "true", "resourceVersion": since, "timeoutSeconds": "1"}) as resp:
        events = [json.loads(line) async for line in resp.content if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]

    kube.compact()
    async with kube.get(PODS_URL, params={"watch": "true", "resourceVersion": since}) as resp:
        events = [json.loads(line) async for line in resp.content if line.strip()]
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


async def test_finalizers_hold_deletion_until_released(kube: KubernetesApiEmulator) -> None:
    await kube.post(PODS_URL, json={"metadata": {"name": "a", "finalizers": ["x"]}})
    deleted = await (await kube.delete(f"{PODS_URL}/a")).json()
    assert deleted["metadata"]["deletionTimestamp"]
    await kube.patch(f"{PODS_URL}/a", json={"metadata": {"finalizers": None}})
    assert kube.read_object(PODS, "ns", "a") is None
    await asyncio.sleep(0)
    with pytest.raises(kmock.KubernetesError):
        kube.patch_object(PODS, "ns", "a", {})


async def test_a_running_pod_terminates_through_its_grace_period_until_its_kubelet_is_done() -> None:
    kube = new_emulator(kubelet_seconds=None, gc_seconds=None)  # the test plays kubelet and GC
    async with kube, kmock.Server(kube):
        await kube.post(PODS_URL, json=dict(pod("a"), spec={"nodeName": "n1", "terminationGracePeriodSeconds": 45}))
        await kube.post(PODS_URL, json=pod("unscheduled"))
        deleted = await (await kube.delete(f"{PODS_URL}/a")).json()
        assert deleted["metadata"]["deletionTimestamp"] and deleted["metadata"]["deletionGracePeriodSeconds"] == 45
        # The kubelet's status writes do not remove it: only the kubelet's confirmation does.
        kube.patch_status(PODS, "ns", "a", {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]})
        kube.patch_object(PODS, "ns", "a", {"metadata": {"labels": {"x": "1"}}})
        assert kube.read_object(PODS, "ns", "a")["metadata"]["deletionTimestamp"]
        kube.finish_termination("ns", "a")
        assert kube.read_object(PODS, "ns", "a") is None
        # No kubelet runs an unscheduled pod: it goes at once, as does a forced delete.
        await kube.delete(f"{PODS_URL}/unscheduled")
        assert kube.read_object(PODS, "ns", "unscheduled") is None
        await kube.post(PODS_URL, json=dict(pod("b"), spec={"nodeName": "n1"}))
        await kube.delete(f"{PODS_URL}/b", json={"gracePeriodSeconds": 0})
        assert kube.read_object(PODS, "ns", "b") is None


async def test_the_kubelet_stand_in_finishes_terminations_except_on_a_lost_node() -> None:
    kube = new_emulator(kubelet_seconds=0.05, lost_nodes={"gone"})
    async with kube, kmock.Server(kube):
        await kube.post(PODS_URL, json=dict(pod("a"), spec={"nodeName": "n1"}))
        await kube.post(PODS_URL, json=dict(pod("stuck"), spec={"nodeName": "gone"}))
        await kube.delete(f"{PODS_URL}/a")
        await kube.delete(f"{PODS_URL}/stuck")
        assert kube.read_object(PODS, "ns", "a") is not None
        await asyncio.sleep(0.2)
        assert kube.read_object(PODS, "ns", "a") is None
        assert kube.read_object(PODS, "ns", "stuck")["metadata"]["deletionTimestamp"]
        kube.stop_timers()


async def test_garbage_collection_runs_after_the_owner_went_not_with_it() -> None:
    kube = new_emulator(gc_seconds=0.1)
    async with kube, kmock.Server(kube):
        owner = await (await kube.post(JOBS_URL, json=cartpole_job("j"))).json()
        ref = {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "name": "j", "uid": owner["metadata"]["uid"]}
        await kube.post(PODS_URL, json=dict(pod("child"), metadata={"name": "child", "ownerReferences": [ref]}))
        await kube.delete(f"{JOBS_URL}/j")
        assert kube.read_object(RLJOBS, "ns", "j") is None
        assert kube.read_object(PODS, "ns", "child") is not None  # the collector has not run yet
        await asyncio.sleep(0.3)
        assert kube.read_object(PODS, "ns", "child") is None
        kube.stop_timers()


async def test_non_finite_numbers_are_refused_with_400(kube: KubernetesApiEmulator) -> None:
    await kube.post(JOBS_URL, json=cartpole_job("j"))
    body = '{"status": {"phase": "Running", "progress": {"rewardMean": NaN}}}'
    resp = await kube.patch(f"{JOBS_URL}/j/status", data=body, headers=MERGE)
    assert resp.status == 400 and (await resp.json())["reason"] == "BadRequest"
    assert "status" not in kube.read_object(RLJOBS, "ns", "j")


async def test_a_merge_patch_with_another_uid_conflicts(kube: KubernetesApiEmulator) -> None:
    await kube.post(JOBS_URL, json=cartpole_job("j"))
    resp = await kube.patch(f"{JOBS_URL}/j/status", json={"metadata": {"uid": "other"}, "status": {"phase": "X"}})
    assert resp.status == 409


async def test_watches_that_allow_bookmarks_get_them() -> None:
    kube = new_emulator(bookmark_seconds=0.1)
    async with kube, kmock.Server(kube):
        await kube.post(PODS_URL, json=pod("a"))
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "1", "resourceVersion": "1"}
        async with kube.get(PODS_URL, params=params) as resp:
            events = [json.loads(line) async for line in resp.content if line.strip()]
    bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
    assert bookmarks and bookmarks[0]["object"]["kind"] == "Pod"
    assert bookmarks[-1]["object"]["metadata"]["resourceVersion"] == str(kube._last_revision)


async def test_pods_over_a_resource_quota_are_forbidden_and_usage_follows_the_pods(kube: KubernetesApiEmulator) -> None:
    kube.create_object(
        LIMIT_RANGES,
        "ns",
        {"metadata": {"name": "lr"}, "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "1"}}]}},
    )
    kube.create_object(RESOURCE_QUOTAS, "ns", {"metadata": {"name": "q"}, "spec": {"hard": {"pods": "2", "cpu": "2"}}})
    for name in ("a", "b"):
        body = {"metadata": {"name": name}, "spec": {"containers": [{"name": "c"}]}}
        assert (await kube.post(PODS_URL, json=body)).status == 201
    created = kube.read_object(PODS, "ns", "a")
    assert created["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1"}  # LimitRanger's default
    assert kube.read_object(RESOURCE_QUOTAS, "ns", "q")["status"]["used"] == {"pods": "2", "cpu": "2"}
    refused = await kube.post(PODS_URL, json={"metadata": {"name": "c"}, "spec": {"containers": [{"name": "c"}]}})
    assert refused.status == 403
    status = await refused.json()
    assert status["reason"] == "Forbidden"
    assert status["message"].startswith('pods "c" is forbidden: exceeded quota: q, requested: cpu=1,pods=1')
    kube.delete_object(PODS, "ns", "a")
    assert kube.read_object(RESOURCE_QUOTAS, "ns", "q")["status"]["used"] == {"pods": "1", "cpu": "1"}
