"""Pure builders: a resolved RLJob and the operator settings in, Kubernetes manifests (dicts) out.

No API server, no kopf: `rljob render` prints exactly what the operator creates. Builders raise
`InvalidRLJob` (naming the field) when a valid job's pods would clash with what rljob adds.
"""

from rljob.operator.manifests.checks import build_problems, checkpoint_dir_in_pod, ensure_buildable
from rljob.operator.manifests.children import build_children
from rljob.operator.manifests.config import build_config_map, config_hash, resolved_job_yaml
from rljob.operator.manifests.gang import build_pod_group, gang_size, replica_counts
from rljob.operator.manifests.network import build_reward_egress_policy, runs_sandboxed_rewards
from rljob.operator.manifests.pods import build_job_pods, build_pod, build_pods, role_image
from rljob.operator.manifests.service import build_service

__all__ = [
    "build_children",
    "build_config_map",
    "build_job_pods",
    "build_pod",
    "build_pod_group",
    "build_pods",
    "build_problems",
    "build_reward_egress_policy",
    "build_service",
    "checkpoint_dir_in_pod",
    "config_hash",
    "ensure_buildable",
    "gang_size",
    "replica_counts",
    "resolved_job_yaml",
    "role_image",
    "runs_sandboxed_rewards",
]
