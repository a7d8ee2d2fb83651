"""The RLJob resource: identity, spec and status."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rljob.api.base import SpecModel
from rljob.api.kubernetes import ObjectMeta
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus

GROUP = "rljob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

MAX_NAME_LENGTH = 47
"""Pod names are `<job>-<role>-<replica>` and must stay valid DNS-1123 labels (63 characters)."""


class RLJob(SpecModel):
    """An RL post-training job: one manifest, run locally or by the operator."""

    api_version: Literal["rljob.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLJob"]
    metadata: ObjectMeta
    spec: RLJobSpec
    status: RLJobStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name
