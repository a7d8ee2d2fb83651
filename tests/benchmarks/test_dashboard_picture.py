"""The dashboard picture draws each panel of the chart's dashboard from metrics.jsonl records, and says which
metrics a local run cannot have."""

from __future__ import annotations

import json

import yaml

from benchmarks.dashboard_picture import DASHBOARD, main, panel_lines
from rljob.runtime.records.metrics import RunMetrics

RECORDS = [
    {"reward_mean": 0.1 * s, "accuracy": 0.05 * s, "tokens_per_s": 900.0 + s, "time_generate_s": 0.2,
     "time_reward_s": 0.01, "time_train_s": 0.3, "time_sync_s": 0.02, "staleness_mean": 0.0, "staleness_max": 0,
     "mismatch_kl": 1e-9, "entropy": 2.0 - 0.1 * s}
    for s in range(1, 6)
]  # fmt: skip


def panels() -> dict[str, dict]:
    return {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}


def records() -> list[dict]:
    return [{"step": s, **r} for s, r in enumerate(RECORDS, start=1)]


def test_role_panels_map_back_to_the_record_keys_their_gauges_are_set_from():
    lines, missing = panel_lines(panels()["Reward"], records(), "arith")
    assert [(line.label, line.values[-1]) for line in lines] == [("arith reward", 0.5)]
    assert missing == ["rljob_episodic_return"]  # gym only
    lines, _ = panel_lines(panels()["Step time split"], records(), "arith")
    assert {line.label for line in lines} == {"arith generate", "arith reward", "arith train", "arith sync"}
    lines, missing = panel_lines(panels()["Tokens/s"], records(), "arith")
    assert lines[0].steps == [1, 2, 3, 4, 5] and lines[0].values[0] == 901.0


def test_operator_panels_draw_nothing_locally_and_name_their_metrics():
    lines, missing = panel_lines(panels()["Restarts"], records(), "arith")
    assert not lines
    assert set(missing) == {"rljob_operator_rljob_actor_restarts_total", "rljob_operator_pod_replacements_total"}


def test_the_picture_is_written_from_a_run_directory(tmp_path):
    with RunMetrics(tmp_path, tensorboard=False) as run:
        for step, record in enumerate(RECORDS, start=1):
            run.log(step, record)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"metadata": {"name": "arith"}}))
    out = tmp_path / "dashboard.png"
    main([str(tmp_path), "--out", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
