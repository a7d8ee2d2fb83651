"""The per-job Secret: the key every pod of the job seals its data-plane messages with.

Every pod mounts it (`SECRET_DIR_IN_POD`) and finds it through RLJOB_TRANSPORT_KEY_FILE; the transport
(rljob/runtime/wire/transport.py) then refuses a request that does not carry an HMAC made with it, so a pod of
another job cannot submit generations, scores or trajectories even where NetworkPolicies are not enforced. The
key is random: the controller makes it when it creates the Secret, once, and never rewrites it (`rljob render`
prints the pods' mount, not the Secret). The RLJob owns it.
"""

from __future__ import annotations

import base64
from typing import Any

from rljob.api import RLJob
from rljob.operator.naming import child_metadata, job_secret_name

SECRET_DIR_IN_POD = "/var/run/rljob/secret"
SECRET_KEY = "transport-key"
KEY_FILE_IN_POD = f"{SECRET_DIR_IN_POD}/{SECRET_KEY}"


def build_job_secret(job: RLJob, key: bytes) -> dict[str, Any]:
    """The job's Secret holding `key` (the caller draws it: builders stay pure)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(job, job_secret_name(job), "secret"),
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(key).decode()},
    }


def secret_volume(job: RLJob, volume_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volume and mount of the job's Secret: readable by the pods' group (fsGroup), nobody else."""
    volume = {"name": volume_name, "secret": {"secretName": job_secret_name(job), "defaultMode": 0o440}}
    return volume, {"name": volume_name, "mountPath": SECRET_DIR_IN_POD, "readOnly": True}
