"""One Pod per role replica: `<job>-<role>-<i>` running `rljob role <role>` in the role's image.

An actor pod with `gpusPerReplica: N` runs N torch.distributed ranks, one per GPU: its env says
LOCAL_WORLD_SIZE=N and WORLD_SIZE=replicas x N without RANK/LOCAL_RANK, and its `rljob role actor` starts
the N ranks itself (`rljob.runtime.wire.ranks`), each with its RANK and LOCAL_RANK, on `cuda:LOCAL_RANK`.

A collocated job (`roles.rollout.collocated`) has no rollout pods: actor pod i's process also starts rollout
replica i (`rljob.runtime.roles.collocated`), in the same container (the device plugin gives a GPU to one container
only; CUDA IPC needs the same GPUs and IPC namespace). That container serves the rollout's ports too
(COLLOCATED_DATA_PORT, COLLOCATED_METRICS_PORT), mounts a memory-backed /dev/shm (weights pass by `ipc` through
it), and runs an image that holds both roles (`role_image`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, replace
from typing import Any

from rljob.api import ROLE_NAMES, InvalidRLJob, RLJob, RoleName
from rljob.api.spec import RoleSpec
from rljob.operator.manifests.checks import (
    CHECKPOINT_VOLUME,
    CONFIG_DIR_IN_POD,
    CONFIG_VOLUME,
    SECRET_VOLUME,
    SHM_VOLUME,
    TMP_VOLUME,
    checkpoint_claim,
    checkpoint_dir_in_pod,
    ensure_buildable,
    weights_through_files,
)
from rljob.operator.manifests.config import config_hash
from rljob.operator.manifests.gang import PodGangMetadata, pod_gang_metadata, replica_counts, role_replicas
from rljob.operator.manifests.members import MEMBERS_FILE_IN_POD, elastic_rollouts, members_volume
from rljob.operator.manifests.placement import GPU_RESOURCE, PlacementProblem, role_affinity, role_tolerations
from rljob.operator.manifests.secret import KEY_FILE_IN_POD, secret_volume
from rljob.operator.manifests.trackers import tracker_env
from rljob.operator.naming import (
    ANNOTATION_CONFIG_HASH,
    LABEL_REPLICA,
    LABEL_ROLE,
    child_metadata,
    config_map_name,
    pod_name,
    service_name,
)
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import (
    COLLOCATED_DATA_PORT,
    COLLOCATED_METRICS_PORT,
    DATA_PORT,
    MASTER_PORT,
    SYNC_PORT,
    TRANSPORT_KEY_FILE_ENV,
    actor_ranks_per_replica,
    pod_identity,
)

CONTAINER_NAME = "main"
"""The container of every role pod; `kubectl logs <pod>` needs no `-c`."""
HEALTH_PATH = "/healthz"
LIVENESS_PATH = "/livez"
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 3
"""`/livez` fails once a loop is stuck for the role's livenessTimeoutSeconds; the kubelet acts after this many
failed probes this far apart (up to 30 s more), so one slow answer never restarts a container."""
STARTUP_PERIOD_S = 5
READ_ONLY_ROOT_ROLES: tuple[RoleName, ...] = ("env", "reward")
"""Roles that run untrusted code (code_exec sandboxes, tool environments): their root filesystem is read-only and
only /tmp (an emptyDir) is writable. The actor and rollout keep a writable root for library caches."""


COLLOCATED_PORT_NAMES = {"rollout-data": COLLOCATED_DATA_PORT, "rollout-metrics": COLLOCATED_METRICS_PORT}
"""The collocated rollout's ports in its actor pod (port names: at most 15 characters)."""


def role_image(job: RLJob, role: RoleName, settings: OperatorSettings) -> str:
    """The role's own image, else the operator default for it (see OperatorSettings).

    The actor pod of a collocated job runs the rollout too, so its one image must hold both: the actor's image,
    else the rollout's own (checks refuse two different ones), else the rollout's default (the rollout image,
    which holds the trainer too, for engine vllm; the trainer image, which holds the hf engine, otherwise)."""
    own = job.spec.roles.get(role).image
    if role == "actor" and job.spec.roles.rollout.collocated and not own:
        return role_image(job, "rollout", settings)
    if own:
        return own
    if role == "actor":
        return settings.trainer_image
    if role == "rollout":
        return settings.rollout_image if job.spec.rollout.engine == "vllm" else settings.trainer_image
    return settings.env_image


@dataclass(frozen=True)
class _JobPods:
    """What every pod of a job shares, computed once per job rather than once per pod."""

    counts: dict[str, int]
    """Pods per role."""
    replicas: dict[str, int]
    """Replicas per role (a collocated rollout's run in the actor pods)."""
    config_hash: str
    gang: PodGangMetadata


def _job_pods(job: RLJob, settings: OperatorSettings) -> _JobPods:
    ensure_buildable(job)
    return _JobPods(replica_counts(job), role_replicas(job), config_hash(job), pod_gang_metadata(job, settings))


def build_pod(job: RLJob, settings: OperatorSettings, role: RoleName, replica: int) -> dict[str, Any]:
    """The pod of one replica of a role of a resolved job; raises InvalidRLJob on clashes (see checks)."""
    return _build_pod(job, settings, role, replica, _job_pods(job, settings))


def build_pods(job: RLJob, settings: OperatorSettings, role: RoleName) -> list[dict[str, Any]]:
    shared = _job_pods(job, settings)
    return [_build_pod(job, settings, role, i, shared) for i in range(shared.counts[role])]


def build_job_pods(job: RLJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Every pod of the job, role by role (actor, rollout, env, reward), replica by replica."""
    shared = _job_pods(job, settings)
    return [_build_pod(job, settings, r, i, shared) for r in ROLE_NAMES for i in range(shared.counts[r])]


def _build_pod(
    job: RLJob, settings: OperatorSettings, role: RoleName, replica: int, shared: _JobPods
) -> dict[str, Any]:
    counts = shared.counts
    if not 0 <= replica < counts[role]:
        raise ValueError(f"{role} replica {replica} is outside the job's {counts[role]} {role} replicas")
    rs = job.spec.roles.get(role)
    try:
        affinity = role_affinity(role, rs)
    except PlacementProblem as exc:
        raise InvalidRLJob([exc.problem]) from None

    metadata = child_metadata(job, pod_name(job, role, replica), role)
    gang = shared.gang
    labels: dict[str, str] = {**settings.extra_pod_labels, **metadata["labels"]}  # type: ignore[dict-item]
    labels.update({LABEL_ROLE: role, LABEL_REPLICA: str(replica)})
    labels.update(gang.labels)
    metadata["labels"] = labels
    metadata["annotations"] = {ANNOTATION_CONFIG_HASH: shared.config_hash, **gang.annotations}

    volumes, mounts = _volumes(job, role, rs, settings)
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(job, role, replica),
        "subdomain": service_name(job),
        # The operator owns restarts: a failed actor restarts the whole group, other roles are replaced.
        "restartPolicy": "Never",
        # The actor finishes or abandons its step and writes its checkpoint after SIGTERM (exit EXIT_PREEMPTED):
        # spec.checkpoint.preemptionGraceSeconds is sized for that; the other roles only stop.
        "terminationGracePeriodSeconds": job.spec.checkpoint.preemption_grace_seconds
        if role == "actor"
        else settings.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_group,
            "fsGroup": settings.run_as_group,
            # Large dataset and checkpoint volumes: chown only when the root's group differs.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(job, role, replica, rs, settings, mounts, shared.replicas)],
        "volumes": volumes,
    }
    if settings.pod_service_account:
        pod_spec["serviceAccountName"] = settings.pod_service_account
    else:
        pod_spec["automountServiceAccountToken"] = False
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    if gang.scheduler_name:
        pod_spec["schedulerName"] = gang.scheduler_name
    placement = rs.placement
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(placement.node_selector)
    if affinity:
        pod_spec["affinity"] = affinity
    tolerations = role_tolerations(rs)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _container(
    job: RLJob,
    role: RoleName,
    replica: int,
    rs: RoleSpec,
    settings: OperatorSettings,
    mounts: list[dict[str, Any]],
    replicas: dict[str, int],
) -> dict[str, Any]:
    metrics_port = job.spec.logging.prometheus_port
    collocated = job.spec.roles.rollout.collocated
    identity = pod_identity(
        job.name,
        job.metadata.namespace or "default",
        role,
        replica,
        replicas,
        metrics_port,
        actor_ranks_per_replica=actor_ranks_per_replica(job),
        collocated_rollout=collocated,
    )
    if role == "actor" and elastic_rollouts(job):
        # The rollouts of the environment are those at creation; the membership file follows scaling.
        identity = replace(identity, rollout_members_file=MEMBERS_FILE_IN_POD)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in identity.to_env().items()]
    env.append({"name": TRANSPORT_KEY_FILE_ENV, "value": KEY_FILE_IN_POD})  # the job's Secret: see secret.py
    if role == "actor":  # actor 0 logs to the trackers; its ranks and replicas share one image and env
        env += tracker_env(job)
    env += [var.model_dump(mode="json", by_alias=True, exclude_none=True) for var in rs.env]
    if not job.metadata.namespace:
        # Rendered without a namespace: the pod learns it from the API when it is created.
        env = [e for e in env if e["name"] != "RLJOB_NAMESPACE"]
        env.insert(1, {"name": "RLJOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    ports = [{"name": "data", "containerPort": DATA_PORT, "protocol": "TCP"}]
    if role == "actor":
        ports += [
            {"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"},
            {"name": "sync", "containerPort": SYNC_PORT, "protocol": "TCP"},
        ]
    ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
    if role == "actor" and collocated:
        ports += [
            {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in COLLOCATED_PORT_NAMES.items()
        ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": role_image(job, role, settings),
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["rljob"],
        "args": ["role", role],
        "env": env,
        "ports": ports,
        # Ready once the role serves (models loaded, peers reached).
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": "metrics"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        **_liveness_probes(job, role),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    if role in READ_ONLY_ROOT_ROLES:
        container["securityContext"]["readOnlyRootFilesystem"] = True
        if not any(e["name"] == "HOME" for e in env):
            env.append({"name": "HOME", "value": "/tmp"})  # caches and config files of libraries land in /tmp
    resources = _resources(rs)
    if resources:
        container["resources"] = resources
    return container


def _liveness_probes(job: RLJob, role: RoleName) -> dict[str, Any]:
    """The container's startup and liveness probes, both on `/livez` (rljob.runtime.wire.liveness): the startup
    probe passes at the role's first heartbeat, within `probes.startupTimeoutSeconds`; after it, the liveness
    probe fails once a loop of the role has not beaten for `probes.livenessTimeoutSeconds` (the process counts
    that itself) and the kubelet kills the container: the pod fails (restartPolicy Never) and the failure policy
    restarts the actor group or replaces the replica. None with a liveness timeout of 0.

    A collocated actor pod also starts the rollout beside it (its engine) before the actor's first beat: its
    startup budget is the larger of the two roles'."""
    roles = job.spec.roles
    if roles.liveness_timeout(role) == 0:
        return {}
    startup_s = roles.startup_timeout(role)
    if role == "actor" and roles.rollout.collocated:
        startup_s = max(startup_s, roles.startup_timeout("rollout"))
    probe = {"httpGet": {"path": LIVENESS_PATH, "port": "metrics"}, "timeoutSeconds": 5}
    return {
        "startupProbe": {
            **probe,
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": -(-startup_s // STARTUP_PERIOD_S),
        },
        "livenessProbe": {**probe, "periodSeconds": LIVENESS_PERIOD_S, "failureThreshold": LIVENESS_FAILURES},
    }


def _resources(rs: RoleSpec) -> dict[str, Any]:
    limits = dict(rs.resources.limits)
    requests = dict(rs.resources.requests)
    if rs.gpus_per_replica > 0:
        # Extended resources are requested through limits (requests default to them and must match).
        limits[GPU_RESOURCE] = rs.gpus_per_replica
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    return resources


def _volumes(
    job: RLJob, role: RoleName, rs: RoleSpec, settings: OperatorSettings
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job)}}]
    mounts: list[dict[str, Any]] = [{"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR_IN_POD, "readOnly": True}]
    secret, secret_mount = secret_volume(job, SECRET_VOLUME)
    volumes.append(secret)
    mounts.append(secret_mount)
    volumes += [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in rs.volumes]
    mounts += [m.model_dump(mode="json", by_alias=True, exclude_none=True) for m in rs.volume_mounts]
    user_paths = [posixpath.normpath(m.mount_path) for m in rs.volume_mounts]
    if role == "actor" and elastic_rollouts(job):
        volume, mount = members_volume(job)
        volumes.append(volume)
        mounts.append(mount)
    if role == "actor":
        checkpoint = _checkpoint_volume(job, user_paths)
        if checkpoint is not None:
            volumes.append(checkpoint)
            mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint_dir_in_pod(job)})
    claim = checkpoint_claim(job)
    if role == "rollout" and weights_through_files(job) and claim:
        # The rollouts read the weight files the actor writes under `<checkpoint.dir>/weights/`.
        volumes.append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": checkpoint_dir_in_pod(job), "readOnly": True})
    if role in READ_ONLY_ROOT_ROLES and "/tmp" not in user_paths:
        # The only writable place of a read-only root: sandbox working directories, library caches.
        volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
        mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    # A collocated actor pod passes weights to its rollout through /dev/shm (`weightSync.method: ipc`): the CPU
    # path copies every tensor there, far past the container runtime's 64 MiB, whatever the GPU setting.
    collocated = role == "actor" and job.spec.roles.rollout.collocated
    gpu_shm = settings.gpu_shared_memory and rs.gpus_per_replica > 0
    if (gpu_shm or collocated) and "/dev/shm" not in user_paths:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return volumes, mounts


def _checkpoint_volume(job: RLJob, user_paths: list[str]) -> dict[str, Any] | None:
    """The actor's checkpoint volume at `checkpoint.dir`.

    - `checkpoint.volumeClaim` set: that PersistentVolumeClaim; checkpoints outlive pods, so a restarted
      actor group resumes (with several actor pods on several nodes the claim must be ReadWriteMany).
    - no claim, and one of the role's own volumes is mounted at the directory or above it: theirs.
    - otherwise the claim the operator makes (`<job>-checkpoints`, rljob/operator/manifests/storage.py), unless
      `checkpoint.storage.persistent: false` (or no checkpoints are written): an emptyDir, whose checkpoints
      survive a container restart but not a recreated pod, so an actor-group restart starts again at step 1.
    """
    claim = checkpoint_claim(job)
    if claim:
        return {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    ckpt = posixpath.normpath(checkpoint_dir_in_pod(job))
    if any(ckpt == path or ckpt.startswith(path.rstrip("/") + "/") for path in user_paths):
        return None
    return {"name": CHECKPOINT_VOLUME, "emptyDir": {}}
