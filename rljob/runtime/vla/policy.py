"""The VLA actor-critic: a vision-language model reads the camera image and the instruction and emits each action
dimension as one of its reserved action tokens (OpenVLA); a value head on the backbone's last hidden state of the
prompt gives PPO its baseline.

Decoding is parallel, as in OpenVLA-OFT: the prompt is followed by `dims - 1` query tokens, and the logits at the
prompt's last token and at each query token, restricted to the action tokens, are the distributions of action
dimensions 1..dims. One forward pass gives every dimension and the value, for acting and for the PPO update alike.
The same interface as `rljob.runtime.gym.models.MLPActorCritic`: `act`, `evaluate`, `value`, `discrete`,
`action_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Categorical

from rljob.api.spec import ModelSpec, RLJobSpec
from rljob.runtime.vla.images import Patcher, check_image_space
from rljob.runtime.vla.tokens import ActionTokenizer

ACTION_TOKEN = "<act_{}>"
"""The builtin tokenizer's reserved action tokens (a checkpoint's are the last `bins` of its base vocabulary)."""


@dataclass(frozen=True)
class VLAInputs:
    """What stays fixed for a job: the prompt's token ids (image tokens included) and the action token ids."""

    prompt_ids: list[int]
    query_id: int
    action_ids: list[int]
    image_token_id: int


class VLAActorCritic(nn.Module):
    def __init__(self, backbone: nn.Module, inputs: VLAInputs, patcher: Patcher, tokenizer: ActionTokenizer) -> None:
        super().__init__()
        self.backbone = backbone
        self.patcher = patcher
        self.actions = tokenizer
        self.discrete = tokenizer.discrete
        self.action_shape = tokenizer.action_shape
        width = backbone.config.get_text_config().hidden_size
        dtype = next(backbone.parameters()).dtype
        self.value_head = nn.Linear(width, 1, dtype=dtype)
        nn.init.orthogonal_(self.value_head.weight, 1.0)
        nn.init.constant_(self.value_head.bias, 0.0)
        ids = inputs.prompt_ids + [inputs.query_id] * (tokenizer.dims - 1)
        self.register_buffer("input_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        self.register_buffer("action_ids", torch.tensor(inputs.action_ids, dtype=torch.long), persistent=False)
        self.prompt_length = len(inputs.prompt_ids)
        self.input_shape = (patcher.height, patcher.width, patcher.channels)
        """One observation as the policy takes it (PPO reshapes batches to [n, *input_shape])."""
        self.image_token_id = inputs.image_token_id

    def heads(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """(action-token logits [B, dims, bins], values [B]) for a batch of images, flat or [B, H, W, C]."""
        b = obs.shape[0]
        device = self.input_ids.device
        pixel_values, grid = self.patcher(obs.to(device))
        dtype = self.value_head.weight.dtype
        input_ids = self.input_ids.unsqueeze(0).expand(b, -1)
        out = self.backbone.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixel_values.to(dtype),
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == self.image_token_id).int(),
            use_cache=False,
        )
        hidden = out.last_hidden_state
        start = self.prompt_length - 1
        action_hidden = hidden[:, start : start + self.actions.dims]
        rows = self.backbone.get_output_embeddings().weight[self.action_ids]  # [bins, width]
        logits = action_hidden @ rows.T
        return logits.float(), self.value_head(hidden[:, start]).squeeze(-1).float()

    def value(self, obs: Tensor) -> Tensor:
        return self.heads(obs)[1]

    def policy_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """(action-token logits, values): [B, bins] logits for Discrete actions (what PPO's fast path reads), else
        [B, dims, bins]."""
        logits, values = self.heads(obs)
        return (logits[:, 0] if self.discrete else logits), values

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Sample actions for a batch of images -> (actions, logprobs [B], values [B])."""
        logits, values = self.heads(obs)
        dist = Categorical(logits=logits)
        indices = logits.argmax(-1) if deterministic else dist.sample()
        return self.actions.to_actions(indices), dist.log_prob(indices).sum(-1), values

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probabilities, entropies and values of taken actions, with gradients (the PPO update)."""
        logits, values = self.heads(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        indices = self.actions.to_indices(actions.to(logits.device))
        logprobs = log_probs.gather(-1, indices.unsqueeze(-1)).squeeze(-1).sum(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).sum(-1)
        return logprobs, entropy, values


def _builtin(spec_model: ModelSpec, prompt: str, bins: int, dims: int, seed: int) -> tuple[nn.Module, Any, list[int]]:
    """tiny-qwen2-vl with a tokenizer learned from the prompt, plus `bins` action tokens."""
    from rljob.runtime.llm.models.policy import (
        VISION_TOKENS,
        build_char_tokenizer,
        build_tiny_qwen2_vl,
        tiny_image_processor,
    )

    tokenizer = build_char_tokenizer([prompt])
    actions = [ACTION_TOKEN.format(i) for i in range(bins)]
    tokenizer.add_special_tokens({"additional_special_tokens": [*VISION_TOKENS, *actions]})
    tokenizer.image_processor = tiny_image_processor(spec_model)
    max_length = 4096  # image tokens + prompt + query tokens, far below this for the small images it reads
    model = build_tiny_qwen2_vl(spec_model, tokenizer, max_length, seed)
    return model, tokenizer, tokenizer.convert_tokens_to_ids(actions)


def _checkpoint(spec_model: ModelSpec, bins: int, base_dir: Path | None) -> tuple[nn.Module, Any, list[int]]:
    """A Qwen2-VL style checkpoint; its action tokens are the last `bins` tokens of its base vocabulary (OpenVLA's
    choice: the least used ones, overwritten by training)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from rljob.runtime.llm.models.policy import ModelSourceError, model_source

    source = model_source(spec_model, base_dir)
    remote = spec_model.trust_remote_code
    field = "spec.model.path" if spec_model.source == "local" else "spec.model.hubId"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote)
        tokenizer.image_processor = AutoImageProcessor.from_pretrained(source, trust_remote_code=remote)
        # float32, as every gym policy trains (trainer.precision is an llm setting)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32, trust_remote_code=remote)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{field}: cannot load {source!r} as a vision-language model ({exc})") from None
    base = int(tokenizer.vocab_size)
    return model, tokenizer, list(range(base - bins, base))


def build_vla_actor_critic(
    spec: RLJobSpec, observation_space: Any, action_space: Any, base_dir: Path | None = None
) -> VLAActorCritic:
    """The VLA `spec.model` describes, for one environment's spaces (errors name the field to fix)."""
    vla = spec.model.vla
    assert vla is not None
    actions = ActionTokenizer.for_space(action_space, vla.action_bins)
    check_image_space(observation_space)  # before a checkpoint loads, which may take minutes
    prompt = vla.prompt_template.replace("{instruction}", vla.instruction)
    if spec.model.source == "builtin":
        backbone, tokenizer, action_ids = _builtin(spec.model, prompt, actions.bins, actions.dims, spec.trainer.seed)
    else:
        backbone, tokenizer, action_ids = _checkpoint(spec.model, actions.bins, base_dir)
    patcher = Patcher.for_space(observation_space, tokenizer.image_processor)
    image_token = backbone.config.image_token_id
    vision = [backbone.config.vision_start_token_id, *[image_token] * patcher.image_tokens]
    vision.append(backbone.config.vision_end_token_id)
    text = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    query = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = VLAInputs(prompt_ids=vision + text, query_id=int(query), action_ids=action_ids, image_token_id=image_token)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.trainer.seed)
        return VLAActorCritic(backbone, inputs, patcher, actions)
