import math

import pytest
import torch

from rljob.api.spec import TrainerSpec
from rljob.runtime.optim.optimizer import build_optimizer, learning_rate_at, lr_multiplier, set_learning_rate


def test_constant_schedule_with_warmup():
    assert [lr_multiplier(s, 10, "constant", warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_schedule_anneals_like_cleanrl():
    # CleanRL: lr_now = (1 - (update - 1) / num_updates) * lr for update = 1..num_updates
    total = 4
    expected = [1 - (update - 1) / total for update in range(1, total + 1)]
    assert [lr_multiplier(s, total, "linear") for s in range(total)] == pytest.approx(expected)
    assert expected == [1.0, 0.75, 0.5, 0.25]


def test_cosine_schedule_after_warmup():
    # warmup 2 of 6 steps, then progress 0, 1/4, 2/4, 3/4 over the 4 decay steps
    got = [lr_multiplier(s, 6, "cosine", warmup_steps=2) for s in range(6)]
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert got == pytest.approx(expected)


def test_unknown_schedule_names_the_field():
    with pytest.raises(ValueError, match=r"trainer\.lrSchedule"):
        lr_multiplier(0, 10, "step")


@pytest.mark.parametrize(
    ("name", "cls"), [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)]
)
def test_optimizer_built_from_the_trainer_spec(name, cls):
    trainer = TrainerSpec(
        steps=10,
        learning_rate=1e-3,
        optimizer=name,
        optimizer_eps=1e-5,
        weight_decay=0.01,
        lr_schedule="linear",
        warmup_steps=2,
    )
    optimizer = build_optimizer(torch.nn.Linear(2, 2).parameters(), trainer)
    assert isinstance(optimizer, cls)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4)  # warmup step 0 of 2
    assert group["weight_decay"] == 0.01
    if name != "sgd":
        assert group["eps"] == 1e-5
    set_learning_rate(optimizer, learning_rate_at(6, trainer))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 4 / 8))
