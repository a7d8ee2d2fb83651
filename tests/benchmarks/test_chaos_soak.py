"""The chaos soak's bookkeeping: a metrics.jsonl cut back by a resumed actor counts the steps trained again, a torn
last line is not a step, and the recovery percentiles are taken as documented."""

from __future__ import annotations

import json

from benchmarks.chaos_soak import Watch, percentile, read_steps


def write(path, steps, torn: bool = False) -> None:
    text = "".join(json.dumps({"step": s}) + "\n" for s in steps)
    path.write_text(text + ('{"step": ' if torn else ""))


def test_a_cut_back_metrics_file_counts_the_steps_trained_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watch = Watch(path)
    assert watch.poll() == 0  # not written yet
    write(path, range(1, 8), torn=True)
    assert watch.poll() == 7 and read_steps(path) == list(range(1, 8))
    write(path, range(1, 6))  # the actor resumed from its step-5 checkpoint: 6 and 7 will be trained again
    assert watch.poll() == 5
    write(path, range(1, 10))
    assert watch.poll() == 9
    write(path, range(1, 10))  # a preemption resumes at the next step: nothing cut, nothing repeated
    assert watch.poll() == 9
    assert watch.repeated == 2 and watch.cuts == [(7, 5)]


def test_percentiles_pick_the_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 100.0], 0.99) == 100.0
    assert percentile([5.0], 0.99) == 5.0
