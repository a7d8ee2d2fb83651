"""The llm policy: a char tokenizer and tiny Qwen2 built alike everywhere, exported and loaded as HF models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec, TrainerSpec
from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.models.policy import (
    ModelSourceError,
    build_char_tokenizer,
    check_model_source,
    export_hf,
    load_policy,
    policy_dtype,
)

TASK = LLMTask(
    dataset=DatasetSpec(builtin="arithmetic", size=40),
    prompt_template="Q: {prompt}",
    max_prompt_length=16,
    max_response_length=8,
)
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=1))
CPU = torch.device("cpu")


def build(seed: int = 0, rows=None):
    return load_policy(TINY, TASK, arithmetic_rows(40, 0) if rows is None else rows, seed, CPU)


def test_the_char_tokenizer_round_trips_text_and_starts_with_bos():
    tokenizer = build_char_tokenizer(["3+5=8", "hello world\n", "Grüße"])
    for text in ("hello 3+5=", "8  +\n\nworld", "Grüße 3"):
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == 1 + len(text.encode()), text  # one token per character (per byte beyond ASCII)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer("xyz")["input_ids"] == [tokenizer.bos_token_id]  # characters no text holds have no token
    assert tokenizer.padding_side == "left"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_two_builds_from_the_same_rows_and_seed_are_the_same_policy():
    # The actor and every rollout replica build their start policy independently: it must be one policy.
    model_a, tokenizer_a = build(seed=4)
    torch.manual_seed(1234)  # whatever global RNG state each process happens to be in
    model_b, tokenizer_b = build(seed=4)
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab()
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    other, _ = build(seed=5)
    assert not torch.equal(other.state_dict()["lm_head.weight"], state_a["lm_head.weight"])


def test_the_vocabulary_covers_the_rows_and_the_template():
    _, tokenizer = build()
    ids = tokenizer(TASK.prompt_template.format(prompt="7+8=") + "15")["input_ids"]
    assert tokenizer.unk_token_id not in ids


def test_an_exported_policy_loads_with_auto_classes_and_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = build(seed=2)
    exported = export_hf(model, tokenizer, tmp_path / "model")
    assert (exported / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(exported)
    for text in ("Q: 4+4=8", "Q:  12+9=21\n", "\n Q 1"):
        assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
    text = "Q: 4+4=8"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert loaded_tokenizer.decode(ids[0], skip_special_tokens=True) == text
    assert (loaded_tokenizer.bos_token_id, loaded_tokenizer.eos_token_id, loaded_tokenizer.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6)
    # A second export replaces the first in place.
    export_hf(loaded, loaded_tokenizer, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_local_source_loads_an_exported_directory(tmp_path):
    model, tokenizer = build(seed=2)
    export_hf(model, tokenizer, tmp_path / "exported")
    local = ModelSpec(source="local", path="exported")
    check_model_source(local, base_dir=tmp_path)
    loaded, loaded_tokenizer = load_policy(local, TASK, [], 0, CPU, base_dir=tmp_path)
    assert loaded_tokenizer.padding_side == "left"
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer("Q: 1+1=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6)


def test_a_local_directory_without_config_names_spec_model_path(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelSourceError, match=r"^spec\.model\.path: .*weights has no config\.json"):
        check_model_source(ModelSpec(source="local", path=str(tmp_path / "weights")))
    with pytest.raises(ModelSourceError, match=r"^spec\.model\.path: .*missing does not exist"):
        load_policy(ModelSpec(source="local", path=str(tmp_path / "missing")), TASK, [], 0, CPU)


def test_an_uncached_hub_model_while_offline_names_spec_model_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = ModelSpec(source="hub", hub_id="rljob-tests/model-that-is-not-cached")
    with pytest.raises(
        ModelSourceError, match=r"^spec\.model\.hubId: 'rljob-tests/model-that-is-not-cached' is not in"
    ):
        check_model_source(spec)


@pytest.mark.parametrize(
    ("precision", "device", "dtype"),
    [
        ("auto", "cuda", torch.bfloat16),
        ("auto", "cpu", torch.float32),
        ("fp32", "cuda", torch.float32),
        ("fp16", "cuda", torch.float16),
        ("bf16", "cpu", torch.float32),
    ],
)
def test_the_policy_computes_in_bf16_on_cuda_with_auto_and_in_fp32_on_the_cpu(precision, device, dtype):
    # fp32 stays the default: with ddp a bf16 policy's optimizer steps bf16 weights (see TrainerSpec.precision).
    assert TrainerSpec(steps=1).precision == "fp32"
    assert policy_dtype(TINY, precision, torch.device(device)) == dtype
    assert policy_dtype(TINY.model_copy(update={"dtype": "float32"}), precision, torch.device(device)) == torch.float32


@pytest.mark.parametrize(
    ("actor_gpus", "precision", "dtype"),
    [(1, "bf16", torch.bfloat16), (1, "auto", torch.bfloat16), (0, "bf16", torch.float32), (1, "fp32", torch.float32)],
)
def test_rollouts_hold_the_dtype_the_actor_sends_whatever_their_own_device(actor_gpus, precision, dtype):
    """A CPU hf rollout of a bf16 CUDA actor holds bf16: a broadcast into fp32 staging would read garbage."""
    from rljob.api import validate_job
    from rljob.api.loading import parse_documents
    from rljob.launch.overrides import apply_overrides
    from rljob.runtime.llm.setup import sent_dtype

    example = Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny-arithmetic.yaml"
    document = parse_documents(example.read_text())[0]
    job = validate_job(
        apply_overrides(
            document.data,
            [f"spec.roles.actor.gpusPerReplica={actor_gpus}", f"spec.trainer.precision={precision}"],
        )
    )
    assert sent_dtype(job.spec) == dtype
