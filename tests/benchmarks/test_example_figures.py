"""The examples' figures script: what it reads from a run and how a marked docs span is rewritten."""

from __future__ import annotations

from benchmarks.example_figures import marked_spans, render_figure, rewrite, summarise


def records(accuracies: list[float], held_out: dict[int, float]) -> list[dict]:
    return [
        {
            "step": i + 1,
            "wall_time": 2.0 * (i + 1),
            "accuracy": a,
            "entropy": 1.0 - a,
            "eval_accuracy": held_out.get(i + 1),
        }
        for i, a in enumerate(accuracies)
    ]


def test_a_run_is_summarised_by_its_first_and_last_ten_steps_and_evaluations():
    summary = summarise(records([0.0] * 10 + [0.5] * 5 + [1.0] * 10, {5: 0.1, 25: 0.9}))
    assert summary["steps"] == 25 and summary["training_s"] == 50.0
    assert summary["accuracy_first"] == 0.0 and summary["accuracy_last"] == 1.0
    assert (summary["held_out_first"], summary["held_out_last"]) == (0.1, 0.9)
    assert summary["entropy_min"] == 0.0 and summary["return_last_20"] is None


def results() -> dict:
    runs = [
        {"seed": 0, "held_out_first": 0.141, "held_out_last": 0.562, "training_s": 48.2, "result_lines": ["done: x"]},
        {"seed": 1, "held_out_first": 0.141, "held_out_last": 0.859, "training_s": 51.9, "result_lines": ["done: y"]},
    ]
    example = {"manifest": "examples/tiny.yaml", "runs": runs, "cpus": 2, "load_average": 1.2}
    return {"examples": {"tiny": example}}


def test_figures_are_ranges_over_the_seeds_and_a_single_value_when_they_agree():
    assert render_figure("tiny.held-out", results()) == "held-out accuracy 0.14 → 0.56\u20130.86 (seeds 0\u20131)"
    assert render_figure("tiny.training-time", results()) == "48\u201352 s of training on 2 CPU cores"
    busy = results()
    busy["examples"]["tiny"]["load_average"] = 5.0  # the seconds of a shared machine say so
    assert (
        render_figure("tiny.training-time", busy)
        == "48\u201352 s of training on 2 CPU cores, shared (load average 5.0)"
    )
    assert render_figure("tiny.result", results()) == (
        "\n```console\n$ .venv/bin/rljob run examples/tiny.yaml\n...\ndone: x\n```\n"
    )


def test_rewriting_fills_every_marked_span_and_changes_nothing_else():
    page = "Learns in <!-- figure: tiny.training-time -->45 s<!-- /figure --> here.\n"
    once = rewrite(page, results())
    figure = "48\u201352 s of training on 2 CPU cores"
    assert once == f"Learns in <!-- figure: tiny.training-time -->{figure}<!-- /figure --> here.\n"
    assert rewrite(once, results()) == once
    assert marked_spans(once) == [("tiny.training-time", figure)]
