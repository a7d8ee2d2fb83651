"""Peering for a hot standby: the operator's priority reaches kopf, which lets only the highest work."""

from __future__ import annotations

from rljob.operator.app import OperatorOptions, kopf_settings


def test_peering_name_and_priority_reach_kopf():
    settings = kopf_settings(OperatorOptions(all_namespaces=True, peering="rljob-operator", priority=7))
    assert settings.peering.name == "rljob-operator" and settings.peering.priority == 7
    assert settings.peering.clusterwide is True and settings.peering.standalone is False


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
