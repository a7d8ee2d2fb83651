"""Where a job's replicas go on a Ray cluster: the same RLJob fields the operator turns into pod placement.

Pure functions over the job and a picture of the cluster's nodes (no `ray` import), so they are tested on
their own and the launcher (rljob/launch/ray_cluster.py) only feeds them what Ray reports:

- `gpusPerReplica` -> the bundle's `GPU`; `placement.gpuProduct` -> Ray's accelerator-type resource
  `accelerator_type:<gpuProduct>` (the value Ray detects on the node, e.g. `H100`, or the one the node was
  started with: `ray start --resources '{"accelerator_type:NVIDIA-H100-80GB-HBM3": 1}'`);
- `resources.requests.cpu` / `.memory` -> `CPU` / `memory` (one CPU per replica when not requested);
- `placement.nodeSelector` -> Ray node labels (`ray start --labels pool=train`), a bundle label selector;
- what Ray cannot express and would change where or how a role runs (`placement.affinity`, volumes, a
  checkpoint volumeClaim, other resource requests, env `valueFrom`) is refused naming the field; what only
  concerns Kubernetes pods (image, tolerations, priorityClassName, gang scheduler, limits) is reported as
  not applying on Ray, never dropped silently.

Every replica is one bundle of one placement group per job, reserved before anything starts (gang
semantics). A job that can never fit the cluster fails at once naming the field and the missing resource.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rljob.api import ROLE_NAMES, RLJob
from rljob.launch.supervisor import LaunchError

DEFAULT_CPUS_PER_REPLICA = 1.0
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001
"""What a bundle takes of the node's accelerator-type resource (Ray's own convention): it only matches nodes."""

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def quantity(value: int | str, path: str) -> float:
    """A Kubernetes quantity (`500m`, `2`, `16Gi`) as a number."""
    match = _QUANTITY.match(str(value))
    if not match or match.group(2) not in _SUFFIX:
        raise LaunchError(f"{path}: {value!r} is not a quantity Ray can take; write it like '500m', '2' or '16Gi'")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


@dataclass(frozen=True)
class Bundle:
    """One replica's reservation in the job's placement group."""

    role: str
    replica: int
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica}"


@dataclass(frozen=True)
class ClusterNode:
    """What Ray says about one alive node."""

    node_id: str
    ip: str
    total: Mapping[str, float]
    available: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in labels.items())


def ray_problems(job: RLJob) -> list[str]:
    """Settings Ray cannot honour that change where or how a role runs: each names its field."""
    problems = []
    spec = job.spec
    if spec.checkpoint.volume_claim:
        problems.append(
            "spec.checkpoint.volumeClaim: a Ray cluster mounts no PersistentVolumeClaim; set spec.checkpoint.dir "
            "to a directory on storage every node shares (NFS, a mounted bucket) and remove volumeClaim"
        )
    if spec.roles.rollout.collocated:
        problems.append(
            "spec.roles.rollout.collocated: Ray places the rollout as a replica of its own, which may land on "
            "another node than the actor whose memory it must open; set false (with rollout.weightSync.method "
            "broadcast), or run the collocated job with `rljob run` on one node"
        )
    for role in ROLE_NAMES:
        rs = spec.roles.get(role)
        if not rs.replicas:
            continue
        base = f"spec.roles.{role}"
        if rs.placement.affinity is not None:
            problems.append(
                f"{base}.placement.affinity: Ray has no node affinity terms; express the constraint as "
                f"{base}.placement.nodeSelector (Ray node labels) or gpuProduct, or run through the operator"
            )
        if rs.volumes or rs.volume_mounts:
            field_name = "volumes" if rs.volumes else "volumeMounts"
            problems.append(
                f"{base}.{field_name}: Ray mounts no pod volumes; use paths every node of the cluster has, "
                "or run through the operator"
            )
        for name in rs.resources.requests:
            if name not in ("cpu", "memory"):
                problems.append(
                    f"{base}.resources.requests.{name}: Ray reserves cpu and memory from requests; GPUs come from "
                    f"{base}.gpusPerReplica, and {name!r} has no Ray resource: remove it"
                )
        for i, var in enumerate(rs.env):
            if var.value_from is not None:
                problems.append(
                    f"{base}.env[{i}].valueFrom: secrets, configmaps and field refs exist only in pods; give "
                    "the variable a value, or set it on the Ray cluster's nodes"
                )
    return problems


def ray_notes(job: RLJob) -> list[str]:
    """Settings that only concern Kubernetes pods: said once, so that none is ignored silently."""
    notes = []
    spec = job.spec
    if spec.scheduling.gang != "none":
        notes.append(
            f"spec.scheduling.gang ({spec.scheduling.gang}) does not apply on Ray: the job's placement group "
            "already reserves every replica before any starts"
        )
    for role in ROLE_NAMES:
        rs = spec.roles.get(role)
        if not rs.replicas:
            continue
        base = f"spec.roles.{role}"
        if rs.image:
            notes.append(f"{base}.image does not apply on Ray: roles run in the Python of the cluster's nodes")
        if rs.placement.tolerations:
            notes.append(f"{base}.placement.tolerations do not apply on Ray (Ray nodes have no taints)")
        if rs.placement.priority_class_name:
            notes.append(f"{base}.placement.priorityClassName does not apply on Ray")
        if rs.resources.limits:
            notes.append(f"{base}.resources.limits are not enforced on Ray; requests are reserved")
    return notes


def job_bundles(job: RLJob) -> list[Bundle]:
    """One bundle per replica, roles in ROLE_NAMES order (actors first), replicas in order."""
    bundles = []
    for role in ROLE_NAMES:
        rs = job.spec.roles.get(role)
        base = f"spec.roles.{role}.resources.requests"
        resources: dict[str, float] = {"CPU": DEFAULT_CPUS_PER_REPLICA}
        if "cpu" in rs.resources.requests:
            resources["CPU"] = quantity(rs.resources.requests["cpu"], f"{base}.cpu")
        if "memory" in rs.resources.requests:
            resources["memory"] = quantity(rs.resources.requests["memory"], f"{base}.memory")
        if rs.gpus_per_replica:
            resources["GPU"] = float(rs.gpus_per_replica)
            if rs.placement.gpu_product:
                resources[ACCELERATOR_PREFIX + rs.placement.gpu_product] = ACCELERATOR_SHARE
        resources = {k: v for k, v in resources.items() if v > 0}
        for i in range(rs.replicas or 0):
            bundles.append(Bundle(role, i, dict(resources), dict(rs.placement.node_selector)))
    return bundles


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def placement_strategy(bundles: Sequence[Bundle], nodes: Sequence[ClusterNode]) -> str:
    """PACK, always: one placement group per job has one strategy for all its bundles.

    STRICT_SPREAD would put every bundle on a node of its own, CPU-only env, rollout and reward replicas
    included, and every job has some. Actor replicas that ask for a node's whole GPUs are spread under PACK
    anyway: no node can hold two of them.
    """
    return "PACK"


def _field_of(role: str, resource: str) -> str:
    base = f"spec.roles.{role}"
    if resource == "GPU":
        return f"{base}.gpusPerReplica"
    if resource.startswith(ACCELERATOR_PREFIX):
        return f"{base}.placement.gpuProduct"
    if resource == "CPU":
        return f"{base}.resources.requests.cpu"
    return f"{base}.resources.requests.{resource}"


def _amount(resource: str, value: float) -> str:
    if resource == "memory":
        return f"{value / 2**30:.3g}Gi"
    return f"{value:g}"


def _unplaceable_bundle(bundle: Bundle, nodes: Sequence[ClusterNode]) -> str:
    """Why no node of the cluster can ever hold this bundle, naming the field."""
    if bundle.labels:
        labelled = [n for n in nodes if n.matches(bundle.labels)]
        if not labelled:
            wanted = ", ".join(f"{k}={v}" for k, v in bundle.labels.items())
            return (
                f"spec.roles.{bundle.role}.placement.nodeSelector: no node of the Ray cluster has the labels "
                f"{wanted} (start nodes with `ray start --labels {wanted.replace(', ', ',')}`, or change nodeSelector)"
            )
        nodes = labelled
    for resource, value in sorted(bundle.resources.items(), key=lambda kv: not kv[0].startswith(ACCELERATOR_PREFIX)):
        largest = max((n.total.get(resource, 0.0) for n in nodes), default=0.0)
        if largest + 1e-9 >= value:
            continue
        where = f" among the nodes labelled {bundle.labels}" if bundle.labels else ""
        if resource.startswith(ACCELERATOR_PREFIX):
            kinds = sorted(
                {k[len(ACCELERATOR_PREFIX) :] for n in nodes for k in n.total if k.startswith(ACCELERATOR_PREFIX)}
            )
            have = f"it has {', '.join(kinds)}" if kinds else "it declares none"
            return (
                f"{_field_of(bundle.role, resource)}: no node of the Ray cluster has the resource {resource}{where} "
                f"({have}); set gpuProduct to one of those, or start GPU nodes with that accelerator type"
            )
        return (
            f"{_field_of(bundle.role, resource)}: each {bundle.role} replica needs {resource} "
            f"{_amount(resource, value)} on one node, but the largest node of the Ray cluster{where} has "
            f"{_amount(resource, largest)}"
        )
    # Every resource fits some node, but no single node has them all together.
    return (
        f"spec.roles.{bundle.role}: no single node of the Ray cluster holds a whole {bundle.role} replica "
        f"({_describe(bundle.resources)})"
    )


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k}: {_amount(k, v)}" for k, v in sorted(resources.items()))


def _pack(bundles: Sequence[Bundle], nodes: Sequence[ClusterNode], strategy: str, available: bool) -> Bundle | None:
    """First-fit of every bundle on the nodes' total or available resources; the first bundle that finds no
    room, None when all fit. The bundles with the fewest nodes they may use go first (a nodeSelector, a GPU
    type), then the largest: an unconstrained replica must not take the only node a pinned one can use."""
    room = {n.node_id: dict(n.available if available else n.total) for n in nodes}
    used: set[str] = set()

    def candidates(bundle: Bundle) -> int:
        return sum(1 for n in nodes if n.matches(bundle.labels) and _fits(bundle.resources, n.total))

    order = sorted(bundles, key=lambda b: (candidates(b), -b.resources.get("GPU", 0.0), -b.resources.get("CPU", 0.0)))
    for bundle in order:
        for node in nodes:
            if strategy == "STRICT_SPREAD" and node.node_id in used:
                continue
            if node.matches(bundle.labels) and _fits(bundle.resources, room[node.node_id]):
                for k, v in bundle.resources.items():
                    room[node.node_id][k] = room[node.node_id].get(k, 0.0) - v
                used.add(node.node_id)
                break
        else:
            return bundle
    return None


def check_fits(bundles: Sequence[Bundle], nodes: Sequence[ClusterNode], strategy: str) -> None:
    """Fail at once when the job can never be placed on this cluster, naming the field and the resource."""
    if not nodes:
        raise LaunchError("the Ray cluster has no alive node")
    for bundle in bundles:
        if not any(n.matches(bundle.labels) and _fits(bundle.resources, n.total) for n in nodes):
            raise LaunchError(_unplaceable_bundle(bundle, nodes))
    needed: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.resources.items():
            needed[k] = needed.get(k, 0.0) + v
    # GPUs first: the scarce resource is the one worth naming.
    for resource, value in sorted(needed.items(), key=lambda kv: (kv[0] != "GPU", kv[0])):
        total = sum(n.total.get(resource, 0.0) for n in nodes)
        if total + 1e-9 < value:
            roles = sorted({b.role for b in bundles if resource in b.resources})
            fields = " + ".join(f"{_field_of(r, resource)} x spec.roles.{r}.replicas" for r in roles)
            raise LaunchError(
                f"{_field_of(roles[0], resource)}: the job needs {resource} {_amount(resource, value)} in all "
                f"({fields}) but the whole Ray cluster has {_amount(resource, total)}"
            )
    misfit = _pack(bundles, nodes, strategy, available=False)
    if misfit is not None:
        raise LaunchError(
            f"spec.roles.{misfit.role}: the job's {len(bundles)} replicas do not fit the Ray cluster's nodes together "
            f"({strategy}): no node is left for {misfit.name} ({_describe(misfit.resources)})"
        )


def waiting_for(bundles: Sequence[Bundle], nodes: Sequence[ClusterNode], strategy: str) -> str | None:
    """What the job waits for when it fits the cluster but not its resources free right now; None if it fits."""
    misfit = _pack(bundles, nodes, strategy, available=True)
    if misfit is None:
        return None
    return f"{misfit.name} needs {_describe(misfit.resources)} free on one node; other work holds it now"
