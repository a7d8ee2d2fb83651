"""Reading actor 0's `/progress`: only the contract's keys, and only numbers JSON can carry."""

from __future__ import annotations

import json

from rljob.api.status import RLJobStatus
from rljob.operator.controller import dump_status
from rljob.operator.progress import parse_progress


def test_non_finite_values_are_left_out_of_the_progress() -> None:
    text = '{"step": 3, "rewardMean": NaN, "entropy": Infinity, "mismatchKl": "-inf", "accuracy": 0.5, "x": 1}'
    progress = parse_progress(json.loads(text))  # Python's json reads NaN and Infinity; Go's refuses them
    assert progress.step == 3 and progress.accuracy == 0.5
    assert progress.reward_mean is None and progress.entropy is None and progress.mismatch_kl is None
    # The status that carries it is JSON a real API server accepts.
    json.dumps(dump_status(RLJobStatus(progress=progress)), allow_nan=False)
