"""The base model every RLJob section derives from: camelCase keys, strict types, no unknown fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """YAML keys are camelCase (Kubernetes convention); Python attributes are snake_case.

    Strict mode mirrors the API server: `replicas: "2"` is a string, not an integer, there too.
    Unknown keys are errors so that typos never pass silently.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
        extra="forbid",
        strict=True,
        validate_default=False,
        use_attribute_docstrings=True,
    )
