"""The controller's pod cache (rljob/operator/podcache.py) against the emulator: what it holds after lists, watch
events, a watch gap and namespaces that come and go, and which jobs it tells."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import kmock
from kubernetes_asyncio.client import Configuration

from rljob.operator import podcache
from rljob.operator.client import KubeClient
from rljob.operator.podcache import PodCache
from tests.operator.controller.conftest import PODS, eventually
from tests.operator.controller.emulator import KubernetesApiEmulator

NAMESPACES = kmock.resource("", "v1", "namespaces")


def pod(namespace: str, name: str, job: str | None) -> dict[str, Any]:
    labels = {"rljob.io/job": job} if job else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": {"big": "x" * 1000}},
        "spec": {"containers": [{"name": "main", "image": "rljob", "env": [{"name": "A", "value": "1"}] * 20}]},
    }


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    def __call__(self, namespace: str, job: str, listed: bool) -> None:
        self.calls.append((namespace, job, listed))


@contextlib.asynccontextmanager
async def following(
    kube: KubernetesApiEmulator, namespaces: Iterable[str] = (), all_namespaces: bool = False
) -> AsyncIterator[tuple[PodCache, Recorder]]:
    told = Recorder()
    cache = PodCache(KubeClient(Configuration(host=str(kube.url).rstrip("/"))), told, retry_seconds=0.1)
    task = cache.start(namespaces, all_namespaces)
    try:
        yield cache, told
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await cache.client.close()


def names(cache: PodCache, namespace: str, job: str) -> set[str]:
    return {p["metadata"]["name"] for p in cache.pods_of(namespace, job)}


async def test_it_lists_in_pages_keeps_what_the_controller_reads_and_follows_changes(kube, monkeypatch) -> None:
    monkeypatch.setattr(podcache, "LIST_PAGE", 2)  # five pods: three pages
    for i in range(5):
        kube.create_object(PODS, "ns", pod("ns", f"a-{i}", "a"))
    kube.create_object(PODS, "ns", pod("ns", "stray", None))  # no job label: not one of an RLJob's pods
    async with following(kube, all_namespaces=True) as (cache, told):
        await asyncio.wait_for(cache.ready("ns"), 10)
        assert names(cache, "ns", "a") == {f"a-{i}" for i in range(5)}
        assert cache.jobs() == [("ns", "a")]
        kept = cache.pods_of("ns", "a")[0]
        assert set(kept) == {"metadata", "spec", "status"} and set(kept["spec"]) == {"nodeName"}
        assert kept["metadata"]["annotations"] == {"big": "x" * 1000}  # the config hash lives in annotations
        assert told.calls == [("ns", "a", True)]

        kube.patch_object(PODS, "ns", "a-0", {"spec": {"nodeName": "node-1"}})
        await eventually(lambda: {p["spec"]["nodeName"] for p in cache.pods_of("ns", "a")} == {"node-1", None})
        assert told.calls[-1] == ("ns", "a", False)
        # Relabelled to another job: it moves, and both jobs hear of it.
        kube.patch_object(PODS, "ns", "a-1", {"metadata": {"labels": {"rljob.io/job": "b"}}})
        await eventually(lambda: names(cache, "ns", "b") == {"a-1"}, what="a-1 filed under b")
        assert "a-1" not in names(cache, "ns", "a")
        assert {("ns", "a", False), ("ns", "b", False)} <= set(told.calls[-2:])
        kube.delete_object(PODS, "ns", "a-1", grace_period_seconds=0)
        await eventually(lambda: cache.pods_of("ns", "b") == [] and ("ns", "b") not in cache.jobs(), what="b gone")


async def test_after_a_watch_gap_it_lists_again_and_drops_what_vanished_meanwhile(kube) -> None:
    for name in ("a-0", "a-1"):
        kube.create_object(PODS, "ns", pod("ns", name, "a"))
    async with following(kube, namespaces=("ns",)) as (cache, told):
        await asyncio.wait_for(cache.ready("ns"), 10)
        told.calls.clear()
        kube.compact()  # the watch ends with 410 Gone...
        kube.delete_object(PODS, "ns", "a-1", grace_period_seconds=0)  # ...and this DELETED event is lost
        await eventually(lambda: names(cache, "ns", "a") == {"a-0"}, what="a-1 dropped by the re-list")
        assert ("ns", "a", True) in told.calls  # the job reads itself live before it acts


async def test_glob_patterns_follow_the_namespaces_that_match_as_they_come_and_go(kube) -> None:
    for namespace in ("team-a", "other"):
        kube.create_object(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        kube.create_object(PODS, namespace, pod(namespace, "j-0", "j"))
    async with following(kube, namespaces=("team-*",)) as (cache, _):
        await asyncio.wait_for(cache.ready("team-a"), 10)
        assert cache.jobs() == [("team-a", "j")]
        kube.create_object(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b"}})
        kube.create_object(PODS, "team-b", pod("team-b", "j-0", "j"))
        await asyncio.wait_for(cache.ready("team-b"), 10)
        await eventually(lambda: names(cache, "team-b", "j") == {"j-0"}, what="team-b followed")
        kube.delete_object(NAMESPACES, None, "team-b")
        await eventually(lambda: ("team-b", "j") not in cache.jobs(), what="team-b forgotten")
        assert ("other", "j") not in cache.jobs()
        assert not [r for r in list(kube) if "/namespaces/other/" in str(r.url)]


async def test_retries_back_off_to_half_a_minute() -> None:
    cache = PodCache(KubeClient(Configuration(host="http://127.0.0.1:1")), Recorder(), retry_seconds=1.0)
    assert [cache._backoff(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    await cache.client.close()


async def test_a_first_pass_waits_for_the_cluster_listing_even_before_the_cache_task_has_run(kube) -> None:
    kube.create_object(PODS, "ns", pod("ns", "a-0", "a"))
    async with following(kube, all_namespaces=True) as (cache, _):
        # No await between starting the cache and asking: the scope is the cluster's already.
        await asyncio.wait_for(cache.ready("ns"), 10)
        assert names(cache, "ns", "a") == {"a-0"}
