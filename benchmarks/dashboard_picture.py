"""Draw the chart's Grafana dashboard from a local run: each panel of `dashboards/rljob.json`, from metrics.jsonl.

There is no Grafana here, so this is the honest stand-in for a screenshot: the dashboard's own panels (titles,
layout, units, the metrics each query reads) drawn with matplotlib from the records of a real `rljob run`. A role
gauge maps back to the record key it is set from (`_GAUGES` in rljob/runtime/records/metrics.py); a panel whose metrics
only exist on a cluster (the operator's) or in no record of the run says so instead of showing a line.

    rljob run examples/grpo-tiny-arithmetic.yaml --out runs/grpo
    python -m benchmarks.dashboard_picture runs/grpo --out docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rljob.runtime.records.metrics import _GAUGES, PHASES, STEP, phase_key, read_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "rljob-operator" / "dashboards" / "rljob.json"
METRIC = re.compile(r"\b(rljob_[a-z_]+)\b")
RECORD_KEYS: dict[str, str] = {name: key for key, (name, _) in _GAUGES.items()}
PHASE_METRIC = "rljob_step_phase_seconds"


@dataclass
class Line:
    label: str
    steps: list[int]
    values: list[float]


def panel_lines(panel: dict[str, Any], records: list[dict[str, Any]], job: str) -> tuple[list[Line], list[str]]:
    """The panel's series drawn from the records, and the metrics of its queries the run has no record for."""
    lines: list[Line] = []
    missing: list[str] = []
    for target in panel["targets"]:
        legend = target.get("legendFormat", "").replace("{{rljob}}", job)
        for metric in dict.fromkeys(METRIC.findall(target["expr"])):
            if metric == PHASE_METRIC:
                keys = [(legend.replace("{{phase}}", phase), phase_key(phase)) for phase in PHASES]
            elif metric in RECORD_KEYS:
                keys = [(legend, RECORD_KEYS[metric])]
            else:
                missing.append(metric)
                continue
            found = False
            for label, key in keys:
                points = [(r[STEP], r[key]) for r in records if isinstance(r.get(key), int | float)]
                if points:
                    found = True
                    steps, values = zip(*points, strict=True)
                    lines.append(Line(label, list(steps), list(values)))
            if not found:
                missing.append(metric)
    return lines, missing


def _why_missing(metric: str) -> str:
    return "operator metric, on a cluster only" if metric.startswith("rljob_operator_") else "not in metrics.jsonl"


def draw(dashboard: dict[str, Any], records: list[dict[str, Any]], job: str, out: Path, source: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // 8
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.7 * rows), constrained_layout=True, squeeze=False)
    fig.suptitle(f"{dashboard['title']}: the dashboard's panels drawn from a local run ({source}), not Grafana")
    for panel in panels:
        axis = axes[panel["gridPos"]["y"] // 8][panel["gridPos"]["x"] // 12]
        axis.set_title(panel["title"], loc="left", fontsize=11)
        axis.grid(alpha=0.3)
        lines, missing = panel_lines(panel, records, job)
        defaults = panel["fieldConfig"]["defaults"]
        scale = 100.0 if defaults.get("unit") == "percentunit" else 1.0
        stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
        if stacked and lines and all(line.steps == lines[0].steps for line in lines):
            axis.stackplot(
                lines[0].steps, *[[v * scale for v in line.values] for line in lines], labels=[x.label for x in lines]
            )
        else:
            for line in lines:
                axis.plot(line.steps, [v * scale for v in line.values], label=line.label, linewidth=1.2)
        axis.set_ylabel({"percentunit": "%", "s": "seconds"}.get(defaults.get("unit", ""), ""))
        if lines:
            axis.set_xlabel("training step")
            axis.legend(fontsize=8, loc="best")
        if not lines:
            axis.set_xticks([])
            axis.set_yticks([])
        if missing:
            where = [f"{m}: {_why_missing(m)}" for m in missing]
            axis.text(
                0.5,
                0.5 if not lines else 0.05,
                "\n".join(where),
                transform=axis.transAxes,
                ha="center",
                va="center" if not lines else "bottom",
                fontsize=8,
                color="0.35",
            )
    for row in axes:
        for axis in row:
            if not axis.get_title(loc="left"):
                axis.set_visible(False)
    fig.savefig(out, dpi=64)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="an `rljob run --out` directory (metrics.jsonl, job.yaml)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    args = parser.parse_args(argv)
    records = [r for r in read_metrics(args.run_dir / "metrics.jsonl") if r.get("phase") != "sft"]
    if not records:
        raise SystemExit(f"{args.run_dir / 'metrics.jsonl'} has no training records: run `rljob run` first")
    job = yaml.safe_load((args.run_dir / "job.yaml").read_text())["metadata"]["name"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(json.loads(args.dashboard.read_text()), records, job, args.out, f"`rljob run` of {job}")
    print(f"{args.out}: {args.out.stat().st_size // 1024} KB from {len(records)} records")


if __name__ == "__main__":
    main()
