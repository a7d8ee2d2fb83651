"""A resolved job as `rljob render` shows it: every default filled in, but not the settings nothing will read."""

from __future__ import annotations

from typing import Any

from rljob.api.job import RLJob

_BUILTIN_FIELDS_READ = {
    "mlp": ("architecture", "hiddenSizes", "activation"),
    "cnn": ("architecture", "hiddenSizes", "activation", "channels", "kernelSizes", "strides"),
    "tiny-qwen2": ("architecture", "hiddenSize", "numLayers", "numHeads"),
    "tiny-qwen2-vl": (
        "architecture",
        "hiddenSize",
        "numLayers",
        "numHeads",
        "visionHiddenSize",
        "visionLayers",
        "patchSize",
    ),
}
"""The `spec.model.builtin` keys each builtin architecture is built from."""


def shown(job: RLJob) -> dict[str, Any]:
    """The resolved job as a manifest, without the builtin network's settings another architecture (or a model
    that is not builtin) would read: a gym job's render does not list a language model's width."""
    document = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    model = document["spec"]["model"]
    if job.spec.model.source != "builtin":
        model.pop("builtin", None)
    else:
        keep = _BUILTIN_FIELDS_READ.get(job.spec.model.builtin.architecture or "", ())
        model["builtin"] = {k: v for k, v in model["builtin"].items() if k in keep}
    return document
