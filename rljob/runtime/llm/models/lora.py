"""LoRA adapters on the policy (`model.lora`), through PEFT.

The adapters go into the loaded transformers model in place (transformers' PEFT integration, `add_adapter`, which
calls PEFT's `inject_adapter_in_model`): the policy stays the same class with the same forward, so log-probs,
shared prompt prefixes and the KV cache work as without adapters. Only the adapters require gradients.

The base weights never change, which gives three things without a second copy of the model:
- the KL reference is the policy with its adapters switched off (`adapters_off`);
- rollouts receive the merged weights W + alpha/r B A under the base model's names (`merged_state_dict`), computed
  tensor by tensor without touching the trained model, so an hf or vLLM rollout loads them as any other weights;
- checkpoints hold the adapters alone (`adapter_state_dict`).

A reward model (the `reward_model` stage) also trains its new scalar head in full: PEFT's `modules_to_save` keeps a
trained copy of it beside the original (`<head>.modules_to_save.default`), which the merged weights, the checkpoints
and an adapter export carry under the head's own name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rljob.api.spec import LLMTask, LoraSpec, ModelSpec

ADAPTER = "default"
"""The adapter's name inside PEFT: a policy carries one."""

TARGETS_FIELD = "spec.model.lora.targetModules"


class LoraTargetError(ValueError):
    """A target module the model lacks; the message names the field, the module and what the model has."""


def linear_names(model: nn.Module) -> list[str]:
    """Dotted names of the model's linear layers (what LoRA can adapt)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def target_problems(model: nn.Module, targets: list[str]) -> list[str]:
    """One message per target that matches no linear layer of `model`, by its last name part or a full name."""
    names = linear_names(model)
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    return [
        f"{TARGETS_FIELD}: the model has no linear layer {target!r}; its linear layers are named {', '.join(leaves)}"
        for target in missing
    ]


def is_trained_key(name: str) -> bool:
    """A tensor that trains under LoRA: an adapter's A or B, or a fully trained module's copy (`modules_to_save`)."""
    return ".lora_" in name or f".modules_to_save.{ADAPTER}." in name


def head_names(model: nn.Module) -> list[str]:
    """The modules of a task model beside its transformer (`base_model_prefix`): a sequence classifier's new head
    (`score` in transformers' decoder models), which a reward model trains in full."""
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, _ in model.named_children() if name != prefix]


def add_lora(model: nn.Module, spec: LoraSpec, train_whole: list[str] | None = None) -> None:
    """Put adapters on `spec.targetModules` of `model`, in place; only they (and the modules named in `train_whole`,
    e.g. a reward model's new head) require gradients afterwards."""
    from peft import LoraConfig

    problems = target_problems(model, spec.target_modules)
    whole = list(train_whole or [])
    problems += [
        f"{TARGETS_FIELD}: {target!r} is the reward model's new head, which trains in full; remove it"
        for target in spec.target_modules
        if target in whole
    ]
    if problems:
        raise LoraTargetError("; ".join(problems))
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        modules_to_save=whole or None,
    )
    model.add_adapter(config, adapter_name=ADAPTER)  # type: ignore[operator]
    for name, param in model.named_parameters():  # PEFT freezes the base; say so here rather than rely on it
        param.requires_grad_(is_trained_key(name))


def has_lora(model: nn.Module) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off (and dropout with it), the training mode restored after."""
    training = model.training
    model.disable_adapters()  # type: ignore[operator]
    model.eval()
    try:
        yield
    finally:
        model.enable_adapters()  # type: ignore[operator]
        model.train(training)


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The policy's state under the base model's names with every adapter merged in: W + alpha/r B A for each
    adapted layer (PEFT's own `get_delta_weight`), a fully trained module's trained copy in place of the original,
    every other tensor as it is. The model is not changed."""
    state = model.state_dict()
    merged = {_base_name(k): v.detach() for k, v in state.items() if ".lora_" not in k and ".original_module." not in k}
    with torch.no_grad():
        for name, layer in _lora_layers(model):
            key = f"{name}.weight"
            base = merged[key]
            merged[key] = base + layer.get_delta_weight(ADAPTER).to(base.dtype)
    return merged


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """alpha / r of each adapted layer, by the layer's name."""
    return {name: float(layer.scaling[ADAPTER]) for name, layer in _lora_layers(model)}


def merge_state(state: dict[str, Tensor], scalings: dict[str, float]) -> dict[str, Tensor]:
    """`merged_state_dict` of a policy's whole state dict as gathered from its shards (fsdp2): W + scale B A for
    each adapted layer (PEFT's delta of a linear layer), every other tensor as it is, under the base names."""
    merged = {_base_name(k): v for k, v in state.items() if ".lora_" not in k and ".original_module." not in k}
    for name, scale in scalings.items():
        key = f"{name}.weight"
        b, a = state[f"{name}.lora_B.{ADAPTER}.weight"], state[f"{name}.lora_A.{ADAPTER}.weight"]
        merged[key] = merged[key] + (scale * (b @ a)).to(merged[key].dtype)
    return merged


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors (and fully trained modules') alone, under the policy's own names (what a checkpoint
    holds)."""
    return {k: v for k, v in model.state_dict().items() if is_trained_key(k)}


PEFT_PREFIX = "base_model.model."
"""How PEFT's adapter file names a tensor: under its `PeftModel` wrapper, without the adapter's name."""


def adapter_file_name(name: str) -> str:
    """The policy's name of an adapter tensor as PEFT's `adapter_model.safetensors` (and vLLM) names it."""
    return PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def adapter_file_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' A and B under the names of PEFT's adapter file: what `model.lora.sync: adapters` sends a vLLM
    rollout, which writes them into an adapter directory and serves it on its base model."""
    return {adapter_file_name(k): v.detach() for k, v in model.state_dict().items() if ".lora_" in k}


def adapter_config(spec: LoraSpec) -> dict[str, Any]:
    """`adapter_config.json` of the adapters `spec` describes on a causal LM (what PEFT writes and vLLM reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }


def load_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a checkpoint's adapters into the policy; every adapter tensor of the policy must be in it."""
    missing = set(adapter_state_dict(model)) - set(state)
    if missing:
        raise KeyError(
            f"the checkpoint lacks the adapter tensors {sorted(missing)[:3]}: it was written without model.lora or "
            "with other targetModules; set them back, or start afresh (checkpoint.resume: never)"
        )
    model.load_state_dict(state, strict=False)


@contextlib.contextmanager
def as_base_model(model: nn.Module) -> Iterator[None]:
    """While inside, `save_pretrained` writes a plain model (config and the state it is given) rather than the
    adapter directory transformers writes for a model with adapters."""
    model._hf_peft_config_loaded = False  # type: ignore[assignment]
    try:
        yield
    finally:
        model._hf_peft_config_loaded = True  # type: ignore[assignment]


def trainable_bytes(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, their bytes): what the optimizer and the gradients scale with."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def check_lora_targets(spec_model: ModelSpec, task: LLMTask, rows: list[dict[str, Any]], base_dir: Path) -> list[str]:
    """Before start: each of `model.lora.targetModules` must name a linear layer of the model. The builtin model is
    built (it is small); a local or hub model is laid out from its config on the meta device, without its weights."""
    from rljob.runtime.llm.models.policy import is_vision_language, load_policy, model_source

    assert spec_model.lora is not None
    if spec_model.source == "builtin":
        model, _ = load_policy(spec_model, task, rows, 0, torch.device("cpu"))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        source = model_source(spec_model, base_dir)
        remote = spec_model.trust_remote_code
        config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=remote)
    return target_problems(model, spec_model.lora.target_modules)
