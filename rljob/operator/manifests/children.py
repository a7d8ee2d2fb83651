"""Everything the operator creates for a job, in creation order."""

from __future__ import annotations

from typing import Any

from rljob.api import RLJob
from rljob.api.upstream import upstream_jobs
from rljob.operator.manifests.checks import ensure_buildable
from rljob.operator.manifests.config import build_config_map
from rljob.operator.manifests.gang import build_pod_group
from rljob.operator.manifests.network import build_isolation_policy, build_reward_egress_policy
from rljob.operator.manifests.pods import build_job_pods
from rljob.operator.manifests.service import build_service
from rljob.operator.manifests.storage import build_checkpoint_claim
from rljob.operator.manifests.upstream import default_upstream_claim, mount_upstream
from rljob.operator.settings import OperatorSettings


def build_children(job: RLJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """ConfigMap, Service, the checkpoint PersistentVolumeClaim (when the operator makes one), PodGroup (when the
    gang scheduler has one), the ingress NetworkPolicy isolating the job's pods (unless switched off), the reward
    pods' egress NetworkPolicy (when they run sandboxed code without network), then every pod of every role.

    The order only lets pods find their config and group when they are admitted; it never encodes
    start-up order: all pods are created together and roles wait for their peers' readiness.

    A model named by another RLJob (`source: job`) is read from that job's claim, mounted read-only; the
    controller passes the job with those claims resolved, anything else (`rljob render`) assumes the claims the
    operator makes (`<job>-checkpoints`).
    """
    job = mount_upstream(job, {name: default_upstream_claim(name) for name in upstream_jobs(job.spec)})
    ensure_buildable(job)
    children = [build_config_map(job, settings), build_service(job, settings)]
    claim = build_checkpoint_claim(job, settings)
    if claim is not None:
        children.append(claim)
    group = build_pod_group(job, settings)
    if group is not None:
        children.append(group)
    isolation = build_isolation_policy(job, settings)
    if isolation is not None:
        children.append(isolation)  # before the pods: none of them is open to other jobs for a moment
    egress = build_reward_egress_policy(job, settings)
    if egress is not None:
        children.append(egress)  # before the pods: a reward pod never runs code without it
    return children + build_job_pods(job, settings)
