"""Operator settings: what a job does not say about its pods (default images, pod identity, scheduler names).

One typed object, built once (from the environment in the operator's Deployment, or from defaults in
`rljob render`) and passed down to the builders. The Helm chart sets every field through the
`RLJOB_OPERATOR_*` variable named next to it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

from rljob import __version__

ImagePullPolicy = Literal["Always", "IfNotPresent", "Never"]
IMAGE_PULL_POLICIES: tuple[str, ...] = ("Always", "IfNotPresent", "Never")

DEFAULT_REGISTRY = "ghcr.io/rljob"
ENV_PREFIX = "RLJOB_OPERATOR_"
_QUANTITY = re.compile(r"^[0-9.]+([eE][0-9]+|[KMGTPE]i?|[kmun])?$")


class SettingsError(ValueError):
    """An `RLJOB_OPERATOR_*` variable holds a value the operator cannot use; names the variable and the fix."""


@dataclass(frozen=True)
class OperatorSettings:
    """Defaults the operator applies to every job's pods.

    Images by role: the actor runs `trainer_image`; the rollout runs `rollout_image` (vLLM on CUDA) when
    its engine is vllm and `trainer_image` otherwise (torch and transformers are in the trainer image,
    so gym jobs do not pull a multi-gigabyte vLLM image); env and reward run `env_image`. A role's own
    `image` always wins. The actor pod of a collocated job runs the rollout too, in the rollout's image
    (`role_image`): the rollout image holds the trainer as well.
    """

    trainer_image: str = f"{DEFAULT_REGISTRY}/trainer:{__version__}"
    """RLJOB_OPERATOR_TRAINER_IMAGE: actor pods (and non-vLLM rollout pods)."""
    rollout_image: str = f"{DEFAULT_REGISTRY}/rollout:{__version__}"
    """RLJOB_OPERATOR_ROLLOUT_IMAGE: rollout pods with engine vllm, and the actor pods of collocated vllm jobs."""
    env_image: str = f"{DEFAULT_REGISTRY}/env:{__version__}"
    """RLJOB_OPERATOR_ENV_IMAGE: env and reward pods."""
    image_pull_policy: ImagePullPolicy = "IfNotPresent"
    """RLJOB_OPERATOR_IMAGE_PULL_POLICY."""
    image_pull_secrets: tuple[str, ...] = ()
    """RLJOB_OPERATOR_IMAGE_PULL_SECRETS: comma-separated Secret names for private registries."""
    pod_service_account: str = ""
    """RLJOB_OPERATOR_POD_SERVICE_ACCOUNT: ServiceAccount of job pods. Empty: the namespace's `default`
    account with no API token mounted (roles never call the API: the operator pulls progress)."""
    run_as_user: int = 1000
    """RLJOB_OPERATOR_RUN_AS_USER: UID of every role container (the images' `rljob` user)."""
    run_as_group: int = 1000
    """RLJOB_OPERATOR_RUN_AS_GROUP: GID, and fsGroup so mounted volumes are writable."""
    termination_grace_period_seconds: int = 60
    """RLJOB_OPERATOR_TERMINATION_GRACE_PERIOD_SECONDS: time a rollout, env or reward pod has after SIGTERM (actor
    pods get the job's `spec.checkpoint.preemptionGraceSeconds`: they write a checkpoint)."""
    volcano_scheduler_name: str = "volcano"
    """RLJOB_OPERATOR_VOLCANO_SCHEDULER_NAME: schedulerName of pods in `gang: volcano` jobs."""
    scheduler_plugins_scheduler_name: str = "scheduler-plugins-scheduler"
    """RLJOB_OPERATOR_SCHEDULER_PLUGINS_SCHEDULER_NAME: the coscheduling scheduler of scheduler-plugins
    (the name its Helm chart installs)."""
    gang_schedule_timeout_seconds: int = 600
    """RLJOB_OPERATOR_GANG_SCHEDULE_TIMEOUT_SECONDS: scheduler-plugins waits this long for the whole gang."""
    gpu_shared_memory: bool = True
    """RLJOB_OPERATOR_GPU_SHARED_MEMORY: mount a memory-backed /dev/shm in GPU pods that do not mount one
    (NCCL and vLLM need more than the container runtime's 64 MiB)."""
    checkpoint_volume_size: str = "50Gi"
    """RLJOB_OPERATOR_CHECKPOINT_VOLUME_SIZE: size of the checkpoint claim the operator makes for a job that sets no
    `spec.checkpoint.storage.size`."""
    checkpoint_storage_class: str = ""
    """RLJOB_OPERATOR_CHECKPOINT_STORAGE_CLASS: StorageClass of that claim when the job names none; empty: the
    cluster's default StorageClass."""
    extra_pod_labels: Mapping[str, str] = field(default_factory=dict)
    """RLJOB_OPERATOR_EXTRA_POD_LABELS: `key=value,key=value` added to every job pod (cost centres, policy)."""
    network_policy: bool = True
    """RLJOB_OPERATOR_NETWORK_POLICY: give each job a NetworkPolicy that admits only its own pods, the operator and
    monitoring (a job's `spec.isolation.networkPolicy` wins)."""
    operator_namespace: str = ""
    """RLJOB_OPERATOR_OPERATOR_NAMESPACE: the operator's namespace, from which it reads `/progress` on the metrics
    port; empty: any namespace (pods with `operator_pod_labels`)."""
    operator_pod_labels: Mapping[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "rljob-operator"})
    """RLJOB_OPERATOR_OPERATOR_POD_LABELS: `key=value,...` labels of the operator's pods (the chart's selector)."""
    monitoring_namespace_labels: Mapping[str, str] = field(default_factory=dict)
    """RLJOB_OPERATOR_MONITORING_NAMESPACE_LABELS: `key=value,...` of the namespaces whose pods (those with
    `monitoring_pod_labels`) may scrape the metrics port; with both empty, no one else may."""
    monitoring_pod_labels: Mapping[str, str] = field(default_factory=dict)
    """RLJOB_OPERATOR_MONITORING_POD_LABELS: `key=value,...` of the pods (Prometheus) that may scrape the metrics
    port."""

    def __post_init__(self) -> None:
        if self.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise SettingsError(
                f"{ENV_PREFIX}IMAGE_PULL_POLICY must be one of {', '.join(IMAGE_PULL_POLICIES)} "
                f"(got {self.image_pull_policy!r})"
            )
        for name in ("trainer_image", "rollout_image", "env_image"):
            if not getattr(self, name):
                raise SettingsError(f"{ENV_PREFIX}{name.upper()} must name an image (got an empty string)")
        for name in ("run_as_user", "run_as_group"):
            if getattr(self, name) < 1:
                raise SettingsError(
                    f"{ENV_PREFIX}{name.upper()} must be a non-root id >= 1 (got {getattr(self, name)})"
                )
        if self.termination_grace_period_seconds < 0:
            raise SettingsError(f"{ENV_PREFIX}TERMINATION_GRACE_PERIOD_SECONDS must be >= 0")
        if not _QUANTITY.match(self.checkpoint_volume_size):
            raise SettingsError(
                f"{ENV_PREFIX}CHECKPOINT_VOLUME_SIZE must be a Kubernetes quantity such as 50Gi "
                f"(got {self.checkpoint_volume_size!r})"
            )
        if self.gang_schedule_timeout_seconds < 1:
            raise SettingsError(f"{ENV_PREFIX}GANG_SCHEDULE_TIMEOUT_SECONDS must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        """Settings from `RLJOB_OPERATOR_*` variables; unset or empty variables keep the defaults."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper(), "").strip()
            if not raw:
                continue
            values[f.name] = _parse(f.name, raw, cls.__dataclass_fields__[f.name].default)
        return cls(**values)  # type: ignore[arg-type]


def _parse(name: str, raw: str, default: object) -> object:
    var = ENV_PREFIX + name.upper()
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{var} must be true or false (got {raw!r})")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{var} must be an integer (got {raw!r})") from None
    if name == "image_pull_secrets":
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if name.endswith("_labels"):
        labels = {}
        for item in raw.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise SettingsError(f"{var} must be `key=value,key=value` (got {raw!r})")
            labels[key.strip()] = value.strip()
        return labels
    return raw
