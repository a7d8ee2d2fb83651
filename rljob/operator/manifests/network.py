"""The job's NetworkPolicies: ingress isolation of every pod, and the egress wall of sandboxed reward pods.

Isolation (`build_isolation_policy`, on unless `spec.isolation.networkPolicy` or the operator's default says no):
a job's pods accept connections from the same job's pods only (data plane, torch.distributed store and weight
rounds, health), plus the metrics port from the operator (which reads the actor's `/progress` there) and from
the monitoring the operator's settings name. Ingress only: what the pods may reach is left alone (datasets,
model hubs), except for sandboxed reward pods below. Kubelet probes come from the node, which NetworkPolicy
implementations admit to local pods.

Reward egress (`build_reward_egress_policy`): reward pods that run model or user code with
`spec.reward.sandbox.network: false`.

In a pod the sandbox usually cannot make a network namespace (the RuntimeDefault seccomp profile refuses
`unshare` without CAP_SYS_ADMIN), so only its audit hook refuses sockets, and native code can get past a
Python audit hook. This policy is the wall outside the pod: the job's reward pods may send nothing but DNS.
The reward role opens no connection itself (it serves the actor's requests on its ZMQ port and its HTTP
health/metrics port, and replies to accepted connections are not egress to a NetworkPolicy), so nothing else
needs allowing. Ingress is left alone (`policyTypes: [Egress]`). It takes a CNI that enforces NetworkPolicy.
"""

from __future__ import annotations

from typing import Any

from rljob.api import RLJob
from rljob.operator.naming import (
    LABEL_ROLE,
    child_metadata,
    isolation_policy_name,
    job_selector,
    reward_egress_policy_name,
)
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import COLLOCATED_METRICS_PORT

DNS_PORT = 53
NETWORK_POLICY_API = "networking.k8s.io/v1"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Every namespace carries its name as this label (Kubernetes >= 1.22): how a policy selects one namespace."""


def isolates_network(job: RLJob, settings: OperatorSettings) -> bool:
    wanted = job.spec.isolation.network_policy
    return settings.network_policy if wanted is None else wanted


def metrics_ports(job: RLJob) -> list[int]:
    """The HTTP ports of the job's pods (`/metrics`, `/progress`, health): the role's, and a collocated rollout's."""
    ports = [job.spec.logging.prometheus_port]
    if job.spec.roles.rollout.collocated:
        ports.append(COLLOCATED_METRICS_PORT)
    return ports


def build_isolation_policy(job: RLJob, settings: OperatorSettings) -> dict[str, Any] | None:
    """The ingress NetworkPolicy of every pod of the job, or None when isolation is off."""
    if not isolates_network(job, settings):
        return None
    ports = [{"protocol": "TCP", "port": port} for port in metrics_ports(job)]
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(settings.operator_pod_labels)}}
    operator["namespaceSelector"] = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}} if settings.operator_namespace else {}
    )
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": job_selector(job)}}]},
        {"from": [operator], "ports": ports},
    ]
    if settings.monitoring_namespace_labels or settings.monitoring_pod_labels:
        monitoring: dict[str, Any] = {"podSelector": {"matchLabels": dict(settings.monitoring_pod_labels)}}
        monitoring["namespaceSelector"] = {"matchLabels": dict(settings.monitoring_namespace_labels)}
        ingress.append({"from": [monitoring], "ports": ports})
    return {
        "apiVersion": NETWORK_POLICY_API,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, isolation_policy_name(job), "network-policy"),
        "spec": {"podSelector": {"matchLabels": job_selector(job)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def runs_sandboxed_rewards(job: RLJob) -> bool:
    """Whether the job's reward pods run code it did not vet: a `code_exec` builtin (model output) or a
    `module:` function (user code, which rljob may run in the sandbox)."""
    functions = job.spec.reward.functions
    return any(f.builtin == "code_exec" or f.module is not None for f in functions)


def build_reward_egress_policy(job: RLJob, settings: OperatorSettings) -> dict[str, Any] | None:
    """DNS-only egress for the job's reward pods, or None when it needs none: no reward pods, no sandboxed
    reward function, or `spec.reward.sandbox.network: true`."""
    del settings
    reward = job.spec.roles.get("reward")
    if reward is None or not reward.replicas or job.spec.reward.sandbox.network or not runs_sandboxed_rewards(job):
        return None
    dns = [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")]
    return {
        "apiVersion": NETWORK_POLICY_API,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, reward_egress_policy_name(job), "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": {**job_selector(job), LABEL_ROLE: "reward"}},
            "policyTypes": ["Egress"],
            "egress": [{"ports": dns}],
        },
    }
