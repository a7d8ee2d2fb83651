"""The dpo stage's loss and gradients are TRL's `DPOTrainer`'s on the same tiny model, reference and pairs.

TRL tokenizes and collates the pairs; the same token ids go through rljob's dpo update pass (`OfflineUpdate`), and
both losses are differentiated on the very policy and reference objects the trainer holds (TRL adjusts the models it
is given, so copies taken before would not be the same models). Tolerances, fp32 on the CPU, where the two sum the
same log-probabilities in a different order: the loss within 1e-5 relative; each gradient element within 1e-4
relative or 1e-5 of its tensor's largest element (ipo's squared loss of about 25 makes gradients large enough for
float32 rounding to show at 3e-5 relative on the smallest elements).
Needs TRL (`pip install trl==1.16.0`, the bench extra); skipped without it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, ModelSpec, TrainerSpec
from rljob.runtime.llm.data.offline_rows import Encoded
from rljob.runtime.llm.models.policy import build_char_tokenizer, build_tiny_qwen2
from rljob.runtime.llm.training.learner import LLMLearner
from rljob.runtime.llm.training.offline import OfflineUpdate

trl = pytest.importorskip("trl")

LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_SCALE_ATOL = 1e-4, 1e-5
PAIRS = [
    {"prompt": "3+4=", "chosen": "7", "rejected": "9"},
    {"prompt": "12+5=", "chosen": "17", "rejected": "71"},
    {"prompt": "2+2=", "chosen": "4", "rejected": "22"},
    {"prompt": "9+0=", "chosen": "9", "rejected": "90!"},
]


def tiny_model(tokenizer):
    spec = ModelSpec(builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2, num_heads=2))
    return build_tiny_qwen2(spec, tokenizer, max_length=64, seed=3)


def trl_side(tmp_path, model, reference, tokenizer, loss_type: str, beta: float, smoothing: float):
    from datasets import Dataset

    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        beta=beta,
        loss_type=[loss_type],
        label_smoothing=smoothing,
        per_device_train_batch_size=len(PAIRS),
        report_to=[],
        use_cpu=True,
        max_length=None,
        seed=0,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return trainer.ref_model, batch, float(loss.detach()), grads


def pairs_from(batch) -> list[Encoded]:
    """TRL's collated [chosen..., rejected...] rows back into (prompt, chosen, rejected) token ids."""
    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    rows = [
        (
            ids[i][(attention[i] == 1) & (completion[i] == 0)].tolist(),
            ids[i][completion[i] == 1].tolist(),
        )
        for i in range(ids.shape[0])
    ]
    half = len(rows) // 2
    pairs = []
    for (prompt, chosen), (prompt_again, rejected) in zip(rows[:half], rows[half:], strict=True):
        assert prompt == prompt_again
        pairs.append(Encoded(prompt, (chosen, rejected)))
    return pairs


@pytest.mark.parametrize(
    ("loss_type", "beta", "smoothing"),
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("ipo", 0.1, 0.0), ("robust", 0.1, 0.2)],
)
def test_dpo_loss_and_gradients_equal_trls_dpotrainer(tmp_path, loss_type, beta, smoothing):
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer(["0123456789+=!"])
    start = tiny_model(tokenizer)
    reference = copy.deepcopy(start).eval().requires_grad_(False)
    with torch.no_grad():  # a policy that already moved away from its reference: the loss is not at its start value
        for p in start.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = start
    reference, batch, their_loss, their_grads = trl_side(
        tmp_path, model, reference, tokenizer, loss_type, beta, smoothing
    )

    algorithm = AlgorithmSpec(name="dpo", dpo={"loss_type": loss_type, "beta": beta, "label_smoothing": smoothing})
    trainer = TrainerSpec(steps=1, batch_size=len(PAIRS), logprob_chunk_tokens=None)
    learner = LLMLearner(
        model, algorithm, trainer, pad_id=tokenizer.pad_token_id, temperature=1.0, max_response_tokens=8
    )
    update = OfflineUpdate(learner, algorithm, reference)
    pairs = pairs_from(batch)
    model.train()
    total, _ = update.pass_loss(pairs)
    loss = total / len(pairs)  # the step divides by the global pair count
    loss.backward()

    assert float(loss.detach()) == pytest.approx(their_loss, rel=LOSS_RTOL)
    assert their_loss > 0.0
    our_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        atol = GRAD_SCALE_ATOL * float(their_grads[name].abs().max())
        torch.testing.assert_close(
            grad, their_grads[name], rtol=GRAD_RTOL, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert any(float(g.abs().max()) > 1e-4 for g in our_grads.values())  # a real gradient, not zeros on both sides
