"""A sequence-classification reward model as a reward function (`spec.reward.functions[i].model`).

The model and its tokenizer load once per reward replica (transformers' AutoModelForSequenceClassification, e.g. the
`model/` export of a `reward_model` job). A sample is scored as the `reward_model` stage trained it: the prompt text
with the special tokens the tokenizer adds, then the response and the end-of-sequence token; its reward is the
model's single logit. Samples are scored `batchSize` at a time, right-padded (the model reads the last token that is
not padding), without gradients, on the reward role's device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rljob.api.spec import RewardModelRef


def model_directory(ref: RewardModelRef, base_dir: Path | None) -> Path:
    if ref.path is None:  # the launchers resolve `job` to a path before any role starts
        raise ValueError(f"reward model of RLJob {ref.job!r} was not resolved to a directory")
    path = Path(ref.path)
    return path if path.is_absolute() else (base_dir or Path.cwd()) / path


def check_reward_model(ref: RewardModelRef, base_dir: Path | None) -> str | None:
    """Why the model at `ref.path` cannot score rewards, or None: read from its config and tokenizer files, without
    loading the weights (preflight runs before any role starts)."""
    directory = model_directory(ref, base_dir)
    if not directory.is_dir():
        return (
            f"{directory} is not a directory: point it at a reward model's export, e.g. <run dir>/model of a "
            "reward_model job"
        )
    config_file = directory / "config.json"
    if not config_file.is_file() and (directory / "adapter_config.json").is_file():
        return (
            f"{directory} holds LoRA adapters alone (adapter_config.json), not a model: export the reward model with "
            "its adapters merged in (model.lora.mergeOnExport: true, the default)"
        )
    if not config_file.is_file():
        return f"{directory} holds no config.json: not a Hugging Face model directory"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"cannot read {config_file}: {exc}"
    architectures = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return (
            f"{directory} is a {', '.join(map(str, architectures)) or 'model of no stated architecture'}, not a "
            "sequence-classification model (…ForSequenceClassification): train one with algorithm.name reward_model"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        return f"{directory} has {labels} outputs; a reward model has one (num_labels: 1)"
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # transformers raises many kinds for a missing or broken tokenizer
        return f"cannot load the tokenizer of {directory}: {exc}"
    return None


class RewardModel:
    """Scores (prompt, response) pairs with the model at `ref.path` on `device`."""

    def __init__(self, ref: RewardModelRef, base_dir: Path | None, device: Any) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = model_directory(ref, base_dir)
        self.batch_size = ref.batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModelForSequenceClassification.from_pretrained(directory).to(self.device).eval()
        # Transformers finds each sequence's last token by the config's pad id: pad with the one the model trained
        # with (a reward_model export states it), else the tokenizer's.
        if self.model.config.pad_token_id is None:
            pad = self.tokenizer.pad_token_id
            self.model.config.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.pad_id: int = self.model.config.pad_token_id

    def encode(self, prompt: str, response: str) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token", None)
        ids = self.tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return [*ids, *self.tokenizer(response, add_special_tokens=False)["input_ids"], *eos]

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        import torch

        scores: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            encoded = [self.encode(p, r) for p, r in pairs[start : start + self.batch_size]]
            longest = max(len(ids) for ids in encoded)
            input_ids = torch.full((len(encoded), longest), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(encoded):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores
