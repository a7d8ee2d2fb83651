"""The GRPO update of a policy with LoRA adapters: only the adapters move, the KL reference is the base with its
adapters off (no second copy), checkpoints hold the adapters and resume the same update."""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.api.spec import AlgorithmSpec, LoraSpec, TrainerSpec
from rljob.runtime.llm.models.lora import add_lora, merged_state_dict
from rljob.runtime.llm.training.learner import LLMLearner
from rljob.runtime.records.checkpoint import CheckpointError
from tests.runtime.llm.training.test_learner import MAX_RESPONSE, TOKENIZER, make_model, make_samples

LORA = LoraSpec(rank=4, alpha=8.0)
KL = AlgorithmSpec(name="grpo", kl_coef=0.1, clip_ratio_high=0.28)


def lora_learner(algorithm: AlgorithmSpec = KL, lora: LoraSpec | None = LORA) -> LLMLearner:
    model = make_model()
    if lora is not None:
        add_lora(model, lora)
    return LLMLearner(
        model,
        algorithm,
        TrainerSpec(steps=10, optimizer="adam", learning_rate=0.01, seed=3),
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
        reference_is_base=lora is not None,
    )


def test_only_the_adapters_change_and_the_kl_is_measured_against_the_base():
    learner = lora_learner()
    assert learner.reference is None  # no second copy of the model
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    first = learner.update(make_samples(0))
    assert first["kl"] == 0.0  # B starts at zero: the adapted policy IS the base before the first step
    second = learner.update(make_samples(1))
    assert second["kl"] > 0.0  # now it has moved away from the base
    after = learner.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed), changed
    assert any(".lora_B." in k for k in changed)
    # Every optimizer state belongs to an adapter tensor.
    adapters = {id(p) for n, p in learner.model.named_parameters() if ".lora_" in n}
    assert set(map(id, learner.optimizer.state)) <= adapters and learner.optimizer.state


def test_a_checkpoint_holds_the_adapters_and_resumes_the_same_update():
    learner = lora_learner()
    learner.update(make_samples(0))
    state = copy.deepcopy(learner.state_dict())  # as read back from disk: no tensor shared with `learner`
    assert state["model"] and all(".lora_" in k for k in state["model"])
    resumed = lora_learner()
    resumed.load_state_dict(state)
    torch.testing.assert_close(merged_state_dict(resumed.model), merged_state_dict(learner.model))
    learner.update(make_samples(1))
    resumed.update(make_samples(1))
    torch.testing.assert_close(merged_state_dict(resumed.model), merged_state_dict(learner.model))


def test_lora_trains_a_fraction_of_the_parameters_and_optimizer_state():
    """Parameter and Adam-state bytes, with and without LoRA, on the same tiny model (RSS would be noise here)."""

    def footprint(learner: LLMLearner) -> tuple[int, int]:
        learner.update(make_samples(0))  # Adam's state exists after a step
        trainable = sum(p.numel() for p in learner.params)
        state = sum(t.numel() * t.element_size() for s in learner.optimizer.state.values() for t in s.values())
        return trainable, state

    full_params, full_state = footprint(lora_learner(AlgorithmSpec(name="grpo", kl_coef=0.0), lora=None))
    lora_params, lora_state = footprint(lora_learner(AlgorithmSpec(name="grpo", kl_coef=0.0)))
    assert lora_params < full_params / 4 and lora_state < full_state / 4


def test_a_checkpoint_of_another_kind_is_refused_with_the_field():
    no_kl = AlgorithmSpec(name="grpo", kl_coef=0.0)
    with_lora = copy.deepcopy(lora_learner(no_kl).state_dict())
    without = copy.deepcopy(lora_learner(no_kl, lora=None).state_dict())
    with pytest.raises(
        CheckpointError, match=r"spec.model.lora: the checkpoint holds LoRA adapters and this job has none"
    ):
        lora_learner(no_kl, lora=None).load_state_dict(with_lora)
    with pytest.raises(CheckpointError, match=r"spec.model.lora: the checkpoint lacks the adapter tensors"):
        lora_learner(no_kl).load_state_dict(without)


def test_a_distilled_student_with_adapters_moves_towards_its_teacher_and_the_teacher_stays_as_it_was():
    """distill with model.lora: the teacher's per-token signal trains only the student's adapters; before the first
    step the adapted student is its base, so its KL to the teacher is the plain student's."""
    from rljob.api.spec import DistillSpec, TeacherModel
    from rljob.runtime.llm.models.policy import build_tiny_qwen2
    from tests.runtime.llm.training.test_learner import TINY

    distill = AlgorithmSpec(
        name="distill", kl_coef=0.0, distill=DistillSpec(teacher=TeacherModel(path="teacher")), clip_ratio_high=0.28
    )
    samples = [{**s, "advantage": 0.0} for s in make_samples(0)]  # the teacher's signal alone

    def learner(lora: LoraSpec | None) -> tuple[LLMLearner, torch.nn.Module]:
        teacher = build_tiny_qwen2(TINY, TOKENIZER, max_length=32, seed=1).eval().requires_grad_(False)
        model = make_model()
        if lora is not None:
            add_lora(model, lora)
        trainer = TrainerSpec(steps=10, optimizer="adam", learning_rate=0.01, seed=3)
        return LLMLearner(
            model,
            distill,
            trainer,
            pad_id=TOKENIZER.pad_token_id,
            temperature=1.0,
            max_response_tokens=MAX_RESPONSE,
            reference_is_base=lora is not None,
            teacher=teacher,
        ), teacher

    plain, _ = learner(None)
    student, teacher = learner(LORA)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in student.model.state_dict().items()}
    first = student.update(samples)
    assert first["distill_kl"] == pytest.approx(plain.update(samples)["distill_kl"], rel=1e-5)
    kls = [first["distill_kl"]] + [student.update(samples)["distill_kl"] for _ in range(7)]
    assert kls[-1] < 0.8 * kls[0], kls
    changed = {k for k, v in student.model.state_dict().items() if not torch.equal(student_before[k], v)}
    assert changed and all(".lora_" in k for k in changed), changed
    assert all(torch.equal(teacher_before[k], v) for k, v in teacher.state_dict().items())
    assert student.reference is None  # distill measures no KL to a reference: nothing else is loaded
