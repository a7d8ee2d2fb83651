"""The egress NetworkPolicy of reward pods that run model or user code with `spec.reward.sandbox.network: false`.

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
from rljob.operator.naming import LABEL_ROLE, child_metadata, job_selector, reward_egress_policy_name
from rljob.operator.settings import OperatorSettings

DNS_PORT = 53
NETWORK_POLICY_API = "networking.k8s.io/v1"


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
