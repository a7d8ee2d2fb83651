"""LoRA on the policy: merged weights for the rollouts, the base as KL reference, exports, target checks."""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.api.spec import BuiltinNetwork, LoraSpec, ModelSpec
from rljob.runtime.llm.models.lora import (
    LoraTargetError,
    adapter_state_dict,
    adapters_off,
    add_lora,
    merged_state_dict,
    target_problems,
)
from rljob.runtime.llm.models.policy import build_char_tokenizer, build_tiny_qwen2

TOKENIZER = build_char_tokenizer(["0123456789+=-*/ abcdefgh"])
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2))
LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def base_model() -> torch.nn.Module:
    return build_tiny_qwen2(TINY, TOKENIZER, max_length=32, seed=0)


def trained_lora_model() -> torch.nn.Module:
    """Adapters as after some training: B is no longer zero, so the merge changes the weights."""
    model = base_model()
    add_lora(model, LORA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def test_the_synced_weights_equal_peft_merge_and_unload_under_the_base_names():
    from peft import LoraConfig, get_peft_model

    model = trained_lora_model()
    merged = merged_state_dict(model)
    peft_model = get_peft_model(
        base_model(), LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules))
    )
    missing, _ = peft_model.load_state_dict(
        {f"base_model.model.{k}": v for k, v in model.state_dict().items()}, strict=False
    )
    assert not [k for k in missing if ".lora_" in k]
    expected = peft_model.merge_and_unload().state_dict()
    assert list(merged) == list(expected) == list(base_model().state_dict())
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base_model().state_dict()[q])  # the adapters are in it
    # The trained model is untouched: still adapters beside a base weight equal to the loaded one.
    assert torch.equal(
        model.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"], base_model().state_dict()[q]
    )


def test_only_adapters_train_and_with_adapters_off_the_policy_is_the_base():
    model = trained_lora_model().train()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert set(adapter_state_dict(model)) == set(trainable)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        with adapters_off(model):
            base_logits = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
        plain = base_model()(input_ids=ids).logits
    torch.testing.assert_close(base_logits, plain)
    assert not torch.allclose(adapted, plain)
    assert model.training  # the mode is restored after the reference pass


def test_a_target_module_the_model_lacks_is_named_with_the_field():
    model = base_model()
    problems = target_problems(model, ["q_proj", "query_key_value"])
    assert len(problems) == 1
    assert problems[0].startswith("spec.model.lora.targetModules: the model has no linear layer 'query_key_value'")
    assert "q_proj" in problems[0]  # what the model has instead
    with pytest.raises(LoraTargetError, match="query_key_value"):
        add_lora(copy.deepcopy(model), LoraSpec(target_modules=["query_key_value"]))
    assert target_problems(model, ["model.layers.0.self_attn.q_proj"]) == []  # a full dotted name too


def test_a_reward_model_trains_adapters_and_its_whole_head_and_merges_into_a_plain_sequence_classifier():
    from transformers import AutoModelForSequenceClassification

    from rljob.runtime.llm.models.lora import head_names
    from rljob.runtime.llm.models.policy import reward_model_from

    model = reward_model_from(base_model(), TOKENIZER.pad_token_id, seed=0)
    plain_keys = list(model.state_dict())
    assert head_names(model) == ["score"]
    add_lora(model, LORA, train_whole=head_names(model))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "score.modules_to_save.default.weight" in trainable
    assert trainable - {"score.modules_to_save.default.weight"} and all(
        ".lora_" in n for n in trainable - {"score.modules_to_save.default.weight"}
    )
    assert set(adapter_state_dict(model)) == trainable  # a checkpoint holds the trained head too
    with torch.no_grad():  # as after training: the adapters and the head moved
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param))
    merged = merged_state_dict(model)
    assert list(merged) == plain_keys  # the plain classifier's names, no adapter or wrapper left
    plain = AutoModelForSequenceClassification.from_config(model.config)
    plain.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(LoraTargetError, match=r"'score' is the reward model's new head"):
        add_lora(reward_model_from(base_model(), 0, seed=0), LoraSpec(target_modules=["score"]), ["score"])


def test_adapters_synced_alone_are_what_peft_writes_into_an_adapter_directory(tmp_path):
    """`model.lora.sync: adapters`: the tensors and names the actor sends, and the config the vLLM rollout writes
    beside them, are PEFT's own adapter directory (what vLLM loads as a LoRA adapter)."""
    import json

    from peft import LoraConfig
    from safetensors.torch import load_file

    from rljob.runtime.llm.models.lora import adapter_config, adapter_file_state

    model = trained_lora_model()
    model.save_pretrained(tmp_path)  # transformers' PEFT integration: the adapter directory alone
    written = load_file(tmp_path / "adapter_model.safetensors")
    sent = adapter_file_state(model)
    assert sorted(sent) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(sent[name], tensor), name
    ours, peft = adapter_config(LORA), json.loads((tmp_path / "adapter_config.json").read_text())
    same = set(ours) - {"target_modules", "task_type"}  # the policy's adapters were put on without a task type
    assert {k: peft[k] for k in same} == {k: ours[k] for k in same}
    assert sorted(peft["target_modules"]) == sorted(ours["target_modules"])
    config = LoraConfig(**{k: v for k, v in ours.items() if k != "peft_type"})
    assert (config.r, config.lora_alpha) == (LORA.rank, LORA.alpha)
