"""The RLJob API: the single source of truth for manifests, the CRD and every role's config."""

from rljob.api.job import API_VERSION, GROUP, KIND, PLURAL, VERSION, RLJob
from rljob.api.loading import load_job_file, load_jobs, validate_job
from rljob.api.problems import InvalidRLJob, Problem
from rljob.api.spec import ROLE_NAMES, RLJobSpec, RoleName
from rljob.api.status import RLJobStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "ROLE_NAMES",
    "VERSION",
    "InvalidRLJob",
    "Problem",
    "RLJob",
    "RLJobSpec",
    "RLJobStatus",
    "RoleName",
    "load_job_file",
    "load_jobs",
    "validate_job",
]
