"""The ingress NetworkPolicy of every job: its pods admit only the same job's pods, the operator and monitoring."""

from __future__ import annotations

import pytest

from rljob.operator.manifests import build_children
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import COLLOCATED_METRICS_PORT
from tests.operator.conftest import EXAMPLES


def isolation(children):
    found = [c for c in children if c["kind"] == "NetworkPolicy" and c["spec"]["policyTypes"] == ["Ingress"]]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.mark.parametrize("example", [p.stem for p in EXAMPLES])
def test_every_example_gets_a_valid_policy_selecting_exactly_its_pods(
    example, example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents[example])
    children = build_children(job, settings)
    policy = isolation(children)
    assert policy is not None
    validate_manifest(policy)
    selector = policy["spec"]["podSelector"]["matchLabels"]
    pods = [c for c in children if c["kind"] == "Pod"]
    assert pods and all(selector.items() <= p["metadata"]["labels"].items() for p in pods)
    # The same job's pods, on every port: data plane, torch.distributed store, weight rounds.
    same_job, *others = policy["spec"]["ingress"]
    assert same_job == {"from": [{"podSelector": {"matchLabels": {"rljob.io/job": job.name}}}]}
    # Anyone else only to the metrics port.
    assert others and all(rule["ports"][0]["port"] == job.spec.logging.prometheus_port for rule in others)


def test_the_operator_is_admitted_from_its_namespace_to_the_metrics_port(example_documents, job_from):
    chart = OperatorSettings(
        operator_namespace="rljob-system",
        operator_pod_labels={"app.kubernetes.io/name": "rljob-operator", "app.kubernetes.io/instance": "rl"},
    )
    policy = isolation(build_children(job_from(example_documents["cartpole-ppo"]), chart))
    operator = policy["spec"]["ingress"][1]
    assert operator == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "rljob-operator", "app.kubernetes.io/instance": "rl"}
                },
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rljob-system"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 9090}],
    }
    assert len(policy["spec"]["ingress"]) == 2  # no monitoring selector: no one else


def test_monitoring_named_by_the_chart_may_scrape_and_a_collocated_rollouts_port_too(
    example_documents, job_from, validate_manifest
):
    chart = OperatorSettings(
        monitoring_namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
        monitoring_pod_labels={"app.kubernetes.io/name": "prometheus"},
    )
    job = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__roles__rollout__collocated=True,
        spec__rollout__weightSync__method="ipc",
    )
    policy = isolation(build_children(job, chart))
    validate_manifest(policy)
    monitoring = policy["spec"]["ingress"][2]
    assert monitoring["from"] == [
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        }
    ]
    assert [p["port"] for p in monitoring["ports"]] == [9090, COLLOCATED_METRICS_PORT]


def test_the_spec_switch_wins_over_the_operator_default(example_documents, job_from):
    document = example_documents["cartpole-ppo"]
    off = OperatorSettings(network_policy=False)
    assert isolation(build_children(job_from(document), off)) is None
    assert isolation(build_children(job_from(document, spec__isolation={"networkPolicy": True}), off)) is not None
    opted_out = job_from(document, spec__isolation={"networkPolicy": False})
    assert isolation(build_children(opted_out, OperatorSettings())) is None


def test_operator_and_monitoring_selectors_come_from_operator_variables():
    settings = OperatorSettings.from_env(
        {
            "RLJOB_OPERATOR_NETWORK_POLICY": "false",
            "RLJOB_OPERATOR_OPERATOR_NAMESPACE": "ops",
            "RLJOB_OPERATOR_OPERATOR_POD_LABELS": "app.kubernetes.io/name=rljob-operator,app.kubernetes.io/instance=x",
            "RLJOB_OPERATOR_MONITORING_NAMESPACE_LABELS": "team=obs",
            "RLJOB_OPERATOR_MONITORING_POD_LABELS": "app=prometheus",
        }
    )
    assert settings.network_policy is False and settings.operator_namespace == "ops"
    assert settings.operator_pod_labels == {
        "app.kubernetes.io/name": "rljob-operator",
        "app.kubernetes.io/instance": "x",
    }
    assert settings.monitoring_namespace_labels == {"team": "obs"}
    assert settings.monitoring_pod_labels == {"app": "prometheus"}
