"""Peering for a hot standby: the operator's priority reaches kopf, which lets only the highest work."""

from __future__ import annotations

from rljob.operator.app import OperatorOptions, kopf_settings


def test_peering_name_and_priority_reach_kopf():
    settings = kopf_settings(OperatorOptions(all_namespaces=True, peering="rljob-operator", priority=7))
    assert settings.peering.name == "rljob-operator" and settings.peering.priority == 7
    assert settings.peering.clusterwide is True and settings.peering.standalone is False


def test_without_peering_the_operator_runs_standalone():
    assert kopf_settings(OperatorOptions(namespaces=("ns",))).peering.standalone is True
