"""The engine a rollout replica generates with: the one `spec.rollout.engine` names, holding the job's starting
policy and wired to its weight sync. The engines themselves (`rljob.runtime.llm.engines`) know nothing of jobs
beyond their settings; what a job's start needs (its rows, the builtin model's seed, the actor's dtype) is here."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig

from rljob.runtime.llm.engines.base import GenerationEngine, WeightSyncSettings, job_cache_len
from rljob.runtime.llm.engines.hf import HFEngine, compiles_decode, generate_buckets
from rljob.runtime.llm.engines.vllm import (
    NOT_INSTALLED,
    VLLMEngine,
    check_cpu_head_size,
    max_model_len,
    startup_failure,
    vision_problem,
    vllm_installed,
    weights_layout,
)
from rljob.runtime.llm.engines.vllm_worker import TensorLayout
from rljob.runtime.llm.models.lora import LoraTargetError, adapter_file_state, add_lora
from rljob.runtime.llm.models.policy import ModelSourceError, export_hf, is_vision_language, model_source
from rljob.runtime.llm.setup import load_job_policy, rollout_gpus, sent_dtype
from rljob.runtime.wire.context import FatalConfigError, RoleContext


def build_engine(context: RoleContext, device: torch.device) -> GenerationEngine:
    """The engine `spec.rollout.engine` names, holding the job's starting policy, wired to its weight sync."""
    spec = context.job.spec
    sync = WeightSyncSettings.from_context(context)
    if spec.rollout.engine == "vllm":
        return start_vllm_engine(context, sync)
    if spec.rollout.engine in (None, "hf"):
        model, tokenizer = load_job_policy(context, device)
        collocated = spec.roles.rollout.collocated
        compiled = compiles_decode(device, collocated)
        # In the dtype the actor sends, not the one this device would pick (a bf16 CUDA actor, a CPU rollout).
        return HFEngine(
            model.to(dtype=sent_dtype(spec)),
            tokenizer,
            device,
            sync,
            collocated,
            batch_buckets=generate_buckets(spec) if compiled else None,
            cache_len=job_cache_len(spec) if compiled else None,
        )
    raise ValueError(f"spec.rollout.engine {spec.rollout.engine!r}: llm rollouts generate with hf or vllm")


def start_vllm_engine(context: RoleContext, sync: WeightSyncSettings) -> VLLMEngine:
    """The job's starting policy in a vLLM engine; a setting the engine cannot start with is exit 78."""
    if not vllm_installed():
        raise FatalConfigError(NOT_INSTALLED)
    spec = context.job.spec
    dtype = sent_dtype(spec)  # the staging tensors must match what the actor sends
    max_len = max_model_len(spec)
    on_cpu = rollout_gpus(spec) == 0 or not torch.cuda.is_available()
    model_dir, layout, owned = engine_model(context, dtype, on_cpu)
    seed = spec.trainer.seed * 1000 + context.identity.replica
    sleep_mode = spec.roles.rollout.collocated and not on_cpu
    unloadable = vision_problem() if is_vision_language(AutoConfig.from_pretrained(model_dir)) else None
    if unloadable is not None:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise FatalConfigError(unloadable)
    adapters = spec.model.lora if spec.model.lora is not None and spec.model.lora.sync == "adapters" else None
    if adapters is not None:
        context.log.info("model.lora.sync adapters: vLLM serves the actor's LoRA adapters on its base model")
    try:
        return VLLMEngine(
            model_dir, layout, spec.rollout, max_len, dtype, sync, seed, on_cpu, owned, sleep_mode, adapters
        )
    except Exception as exc:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        configured = spec.rollout.vllm.max_model_len is not None
        raise FatalConfigError(startup_failure(str(exc), sleep_mode, configured)) from None


def engine_model(context: RoleContext, dtype: torch.dtype, on_cpu: bool) -> tuple[str, TensorLayout, Path | None]:
    """(what vLLM loads, the layout of the state dict the actor sends, a directory this rollout owns or None).

    With `model.lora.sync: adapters` the actor sends the adapter tensors alone: their layout, from the same model
    with the job's adapters put on it (`sent_layout`).

    A builtin model is built (from the seed, as every process of the job builds it) and written to a
    directory of this rollout's; a local directory or hub id is handed to vLLM as it is, and its layout comes
    from a model built on the meta device (no weights read, no memory taken)."""
    spec = context.job.spec
    if spec.model.source != "builtin":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        try:
            source = model_source(spec.model)
        except ModelSourceError as exc:
            raise FatalConfigError(str(exc)) from None
        remote = spec.model.trust_remote_code
        config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
        if on_cpu:
            check_cpu_head_size(spec, config)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        with torch.device("meta"):  # the names the actor sends: its own model class's
            skeleton = auto.from_config(config, trust_remote_code=remote)
            return source, sent_layout(context, skeleton, dtype), None
    model, tokenizer = load_job_policy(context, torch.device("cpu"))
    model = model.to(dtype)
    if on_cpu:
        check_cpu_head_size(spec, model.config)
    base = Path(context.identity.run_dir) / "vllm-models" if context.identity.run_dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    owned = Path(tempfile.mkdtemp(prefix=f"vllm-model-{context.name}-", dir=base))
    export_hf(model, tokenizer, owned / "model")
    return str(owned / "model"), sent_layout(context, model, dtype), owned


def sent_layout(context: RoleContext, model: torch.nn.Module, dtype: torch.dtype) -> TensorLayout:
    """The layout of what each weight sync brings: the whole state dict, or with `model.lora.sync: adapters` the
    adapter tensors the actor's `model.lora` puts on `model` (changed in place: it is not served itself)."""
    lora = context.job.spec.model.lora
    if lora is None or lora.sync != "adapters":
        return weights_layout(model, dtype)
    try:
        add_lora(model, lora)
    except LoraTargetError as exc:
        raise FatalConfigError(str(exc)) from None
    return [(name, list(t.shape), str(dtype).removeprefix("torch.")) for name, t in adapter_file_state(model).items()]
