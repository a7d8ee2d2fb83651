"""A job's children kept packed between passes: the same manifests back, a fraction of the memory."""

from __future__ import annotations

import json

from rljob.operator.controller import parse_job
from rljob.operator.manifests import build_children
from rljob.operator.packed import PackedChildren
from rljob.operator.settings import OperatorSettings
from tests.operator.controller.conftest import cartpole_job


def test_packed_children_unpack_to_the_built_manifests_in_a_fraction_of_their_size():
    body = cartpole_job()
    body["metadata"].update(uid="u-1", generation=1)
    job, invalid = parse_job(body)
    assert invalid is None
    children = build_children(job, OperatorSettings())
    pods = {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}
    others = [c for c in children if c["kind"] != "Pod"]
    packed = PackedChildren(pods, others)
    assert packed.unpack() == (pods, others)
    assert packed.size * 5 < len(json.dumps(children))
    # Each unpack is a fresh copy: what one pass changes never reaches the next.
    first, _ = packed.unpack()
    next(iter(first.values()))["metadata"]["name"] = "changed"
    assert packed.unpack()[0] == pods


def test_the_pods_metadata_stays_at_hand_for_the_planner():
    body = cartpole_job()
    body["metadata"].update(uid="u-1", generation=1)
    job, _ = parse_job(body)
    children = build_children(job, OperatorSettings())
    pods = {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}
    packed = PackedChildren(pods, [])
    assert packed.heads == {name: {"metadata": pod["metadata"]} for name, pod in pods.items()}
    # A copy: the built pods can change (or go) without the heads changing with them.
    next(iter(pods.values()))["metadata"]["labels"]["changed"] = "yes"
    assert all("changed" not in head["metadata"]["labels"] for head in packed.heads.values())
