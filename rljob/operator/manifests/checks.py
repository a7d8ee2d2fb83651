"""What the operator checks before it builds a job's children: the one preflight every launcher shares
(`rljob.runtime.preflight.job_problems`), then what only the pod builders can see: a valid RLJob whose pods
would clash with what rljob adds.

The operator reports these like any invalid spec (Failed, reason InvalidSpec), and `rljob validate` and
`rljob render` print them; each names the field to change.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import replace

from rljob.api import ROLE_NAMES, InvalidRLJob, Problem, RLJob
from rljob.operator.manifests.trackers import tracker_env_names
from rljob.runtime.preflight import job_problems
from rljob.runtime.records.trackers import RESTART_ENV
from rljob.runtime.wire.identity import (
    COLLOCATED_DATA_PORT,
    COLLOCATED_METRICS_PORT,
    CONFIG_PATH_IN_POD,
    DATA_PORT,
    MASTER_PORT,
    SYNC_PORT,
    TRANSPORT_KEY_FILE_ENV,
    pod_identity,
)

CONFIG_VOLUME = "rljob-config"
CHECKPOINT_VOLUME = "rljob-checkpoints"
SHM_VOLUME = "rljob-dshm"
MEMBERS_VOLUME = "rljob-rollouts"
TMP_VOLUME = "rljob-tmp"
SECRET_VOLUME = "rljob-secret"
RESERVED_VOLUMES = (CONFIG_VOLUME, CHECKPOINT_VOLUME, SHM_VOLUME, MEMBERS_VOLUME, TMP_VOLUME, SECRET_VOLUME)
CONFIG_DIR_IN_POD = posixpath.dirname(CONFIG_PATH_IN_POD)
MEMBERS_DIR_IN_POD = "/etc/rljob-rollouts"
"""Where llm actor pods mount the rollout membership ConfigMap (a directory mount: the kubelet refreshes it)."""
DEFAULT_CHECKPOINT_DIR_IN_POD = "/checkpoints"

# Kubernetes label values: at most 63 characters, alphanumerics with '-', '_' or '.' inside.
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def reserved_env_names() -> frozenset[str]:
    """Variables the operator sets from the pod's identity; a role's `env` must not override them."""
    identity = pod_identity("job", "ns", "actor", 0, {r: 1 for r in ROLE_NAMES}, 9090, collocated_rollout=True)
    env = replace(identity, rollout_members_file=MEMBERS_DIR_IN_POD).to_env()
    return frozenset(env) | {TRANSPORT_KEY_FILE_ENV, RESTART_ENV}


def checkpoint_dir_in_pod(job: RLJob) -> str:
    return job.spec.checkpoint.dir or DEFAULT_CHECKPOINT_DIR_IN_POD


def weights_through_files(job: RLJob) -> bool:
    """An llm job whose rollouts load weight files from the checkpoint volume (`weightSync.method: filesystem`)."""
    return job.spec.task.type == "llm" and job.spec.rollout.weight_sync.method == "filesystem"


def operator_checkpoint_claim(job: RLJob) -> str | None:
    """The PersistentVolumeClaim the operator makes for the job's checkpoints (rljob/operator/manifests/storage.py),
    or None: the job names its own (`checkpoint.volumeClaim`), mounts a volume of its own at the checkpoint
    directory in actor pods, asks for an emptyDir (`checkpoint.storage.persistent: false`), or (gym tasks) writes
    no checkpoints and passes no weight files. An llm job always gets one: its trained model is exported there
    (`<checkpoint.dir>/model`), where the next job of a pipeline finds it (`source: job`)."""
    checkpoint = job.spec.checkpoint
    if checkpoint.volume_claim or not checkpoint.storage.persistent:
        return None
    if _mounted_at_or_above(checkpoint_dir_in_pod(job), [m.mount_path for m in job.spec.roles.actor.volume_mounts]):
        return None
    if checkpoint.interval == 0 and not weights_through_files(job) and job.spec.task.type != "llm":
        return None
    return f"{job.name}-checkpoints"


def checkpoint_claim(job: RLJob) -> str | None:
    """The claim actor pods mount at the checkpoint directory: the job's own, else the operator's, else none."""
    return job.spec.checkpoint.volume_claim or operator_checkpoint_claim(job)


def _mounted_at_or_above(path: str, mount_paths: list[str]) -> bool:
    path = posixpath.normpath(path)
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in map(posixpath.normpath, mount_paths))


def build_problems(job: RLJob) -> list[Problem]:
    """The preflight's problems of the job itself, and once there are none, its pods' clashes."""
    return job_problems(job) or list(_problems(job))


def ensure_buildable(job: RLJob) -> None:
    """Raise InvalidRLJob listing every clash; return quietly when the job's pods can be built."""
    problems = build_problems(job)
    if problems:
        raise InvalidRLJob(problems)


def _problems(job: RLJob) -> Iterator[Problem]:
    spec = job.spec
    port = spec.logging.prometheus_port
    if port in (DATA_PORT, MASTER_PORT, SYNC_PORT):
        yield Problem(
            "spec.logging.prometheusPort",
            f"{port} is used inside pods by the data plane ({DATA_PORT}), the actor group ({MASTER_PORT}) "
            f"or weight sync ({SYNC_PORT}): choose another port, e.g. 9090",
        )
    ckpt_dir = checkpoint_dir_in_pod(job)
    if not ckpt_dir.startswith("/"):
        yield Problem("spec.checkpoint.dir", f"must be an absolute path in pods, e.g. /checkpoints (got {ckpt_dir!r})")
    if weights_through_files(job) and not checkpoint_claim(job):
        shared = all(
            _mounted_at_or_above(ckpt_dir, [m.mount_path for m in spec.roles.get(role).volume_mounts])
            for role in ("actor", "rollout")
        )
        if not shared:
            yield Problem(
                "spec.rollout.weightSync.method",
                f"filesystem passes weights through {ckpt_dir}/weights, which actor and rollout pods must share: "
                "set spec.checkpoint.volumeClaim (ReadWriteMany when the pods are on several nodes) or leave "
                "spec.checkpoint.storage.persistent true (the operator's claim), mount a shared volume at "
                "spec.checkpoint.dir in both roles, or use broadcast",
            )
    if spec.roles.rollout.collocated:
        yield from _collocated_problems(job)
    if spec.scheduling.gang == "kueue" and spec.scheduling.queue and not _is_label_value(spec.scheduling.queue):
        yield Problem(
            "spec.scheduling.queue",
            f"becomes the kueue.x-k8s.io/queue-name label: at most 63 letters, digits, '-', '_' or '.' "
            f"(got {spec.scheduling.queue!r})",
        )
    reserved_env = reserved_env_names()
    tracker_secrets = {name: i for name, i in tracker_env_names(job).items() if i >= 0}
    for role in ROLE_NAMES:
        rs = spec.roles.get(role)
        base = f"spec.roles.{role}"
        product = rs.placement.gpu_product
        if product and not _is_label_value(product):
            yield Problem(
                f"{base}.placement.gpuProduct",
                f"must be a node label value like NVIDIA-H100-80GB-HBM3 (got {product!r})",
            )
        for i, var in enumerate(rs.env):
            if var.name in reserved_env:
                yield Problem(
                    f"{base}.env[{i}].name",
                    f"{var.name} is set by the operator from the pod's identity: remove it from env",
                )
            elif role == "actor" and var.name in tracker_secrets:
                yield Problem(
                    f"{base}.env[{i}].name",
                    f"{var.name} is set from spec.logging.trackers[{tracker_secrets[var.name]}].apiKeySecret: "
                    "remove one of the two",
                )
        for i, volume in enumerate(rs.volumes):
            if volume.name in RESERVED_VOLUMES:
                yield Problem(f"{base}.volumes[{i}].name", f"{volume.name!r} is reserved by rljob: rename the volume")
        for i, mount in enumerate(rs.volume_mounts):
            path = posixpath.normpath(mount.mount_path)
            if path == CONFIG_DIR_IN_POD:
                yield Problem(
                    f"{base}.volumeMounts[{i}].mountPath",
                    f"{CONFIG_DIR_IN_POD} holds the job config in every pod: mount the volume elsewhere",
                )
            if role == "actor" and spec.task.type == "llm" and path == MEMBERS_DIR_IN_POD:
                yield Problem(
                    f"{base}.volumeMounts[{i}].mountPath",
                    f"{MEMBERS_DIR_IN_POD} holds the rollout membership in llm actor pods: mount the volume elsewhere",
                )
            if role == "actor" and spec.checkpoint.volume_claim and path == posixpath.normpath(ckpt_dir):
                yield Problem(
                    f"{base}.volumeMounts[{i}].mountPath",
                    f"checkpoint.volumeClaim is mounted at {ckpt_dir} in actor pods: mount this volume elsewhere "
                    "or drop checkpoint.volumeClaim",
                )


COLLOCATED_POD_FIELDS = ("env", "volumes", "volume_mounts", "resources", "placement")
"""Pod settings of a role that a collocated rollout cannot have: it runs in the actor's pod and container."""


def _collocated_problems(job: RLJob) -> Iterator[Problem]:
    """A collocated rollout is a second process of the actor pod's container (rljob/runtime/roles/collocated.py)."""
    spec = job.spec
    port = spec.logging.prometheus_port
    if port in (COLLOCATED_DATA_PORT, COLLOCATED_METRICS_PORT):
        yield Problem(
            "spec.logging.prometheusPort",
            f"{port} is used in the actor pod of a collocated job by the rollout beside the actor (data "
            f"{COLLOCATED_DATA_PORT}, metrics {COLLOCATED_METRICS_PORT}): choose another port, e.g. 9090",
        )
    actor, rollout = spec.roles.actor, spec.roles.rollout
    if actor.image and rollout.image and actor.image != rollout.image:
        yield Problem(
            "spec.roles.rollout.image",
            f"a collocated rollout runs in the actor's container, which has one image: set the same image in "
            f"roles.actor.image and roles.rollout.image, or one of them (got {actor.image!r} and {rollout.image!r})",
        )
    defaults = type(rollout)()
    for name in COLLOCATED_POD_FIELDS:
        if getattr(rollout, name) != getattr(defaults, name):
            alias = type(rollout).model_fields[name].alias or name
            yield Problem(
                f"spec.roles.rollout.{alias}",
                f"a collocated rollout runs in the actor's pod and container: set spec.roles.actor.{alias} "
                "instead, which both processes share",
            )


def _is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.match(value))
