"""Peering for a hot standby: the operator's priority reaches kopf, which lets only the highest work."""

from __future__ import annotations

import asyncio
import contextlib

from rljob.operator.app import OperatorOptions, kopf_settings


def test_peering_name_and_priority_reach_kopf():
    settings = kopf_settings(OperatorOptions(all_namespaces=True, peering="rljob-operator", priority=7))
    assert settings.peering.name == "rljob-operator" and settings.peering.priority == 7
    assert settings.peering.clusterwide is True and settings.peering.standalone is False
    # A killed replica's record lives 15 s (controller-runtime's lease), not kopf's 60 s: the failover bound.
    assert settings.peering.lifetime == 15


def test_without_peering_the_operator_runs_standalone():
    assert kopf_settings(OperatorOptions(namespaces=("ns",))).peering.standalone is True


def test_kopfs_rule_decides_when_an_operator_stands_by():
    import datetime

    from rljob.operator.peering import standby_reason

    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    seen = now.isoformat()

    def peering(**peers: tuple[int, int]) -> dict:
        return {"status": {k: {"priority": p, "lifetime": life, "lastseen": seen} for k, (p, life) in peers.items()}}

    assert standby_reason(peering(me=(10, 60)), "me", 10, now) is None
    assert "higher peering priority (20 > 10)" in standby_reason(peering(me=(10, 60), b=(20, 60)), "me", 10, now)
    assert "same peering priority" in standby_reason(peering(me=(10, 60), b=(10, 60)), "me", 10, now)
    assert standby_reason(peering(me=(10, 60), b=(5, 60)), "me", 10, now) is None
    assert standby_reason(peering(me=(10, 60), b=(20, 0)), "me", 10, now) is None  # b's record expired


async def test_a_dropped_connection_is_an_api_error_the_peering_gate_survives():
    """aiohttp's connection errors are not all OSErrors (a server that drops the connection gives
    ServerDisconnectedError): they reach callers as ApiError (status 0), which the peering gate logs before it
    polls again, instead of ending its loop and the operator with it."""
    import pytest
    from kubernetes_asyncio.client import Configuration

    from rljob.operator.client import ApiError, KubeClient
    from rljob.operator.peering import PeeringGate

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        with pytest.raises(ApiError) as failed:
            await client.get("v1", "ConfigMap", "ns", "name")
        assert failed.value.status == 0
        gate = PeeringGate(client, "rljob", "me", 10, clusterwide=False, poll_seconds=0.01)
        polling = asyncio.create_task(gate.run(lambda: ["ns"], lambda: None))
        await asyncio.sleep(0.3)  # several failed polls
        assert not polling.done()
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await polling
        assert gate.paused  # it never read the peering object: it keeps standing by
    finally:
        await client.close()
        server.close()
