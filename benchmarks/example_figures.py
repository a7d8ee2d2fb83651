"""The figures the README and the docs quote for the shipped examples, measured by running them.

Each example runs under `rljob run` as a user runs it (`--quiet`, one seed per run through
`--set spec.trainer.seed=N`), one after another on this machine. Per run: what `rljob run` prints as its result
(stdout), the health lines it printed (stderr: a healthy example must not be flagged), and from metrics.jsonl the
training accuracy of the first and last 10 steps, the held-out accuracy at the first and last evaluation, the
mean return of the first and last 20 episodes, the episodes' success rate of the first and last 10 steps (tasks
whose env says), the lowest policy entropy and the seconds of training (`wall_time` of the
last step: from actor 0's first step, without start-up). The machine's cores and load average go beside them:
the seconds move with the load.

The docs quote these figures inside `<!-- figure: KEY -->` ... `<!-- /figure -->` markers; `--docs` rewrites
every marked span from the JSON (`render_figure`), and tests/docs/test_figures.py fails when a span and the JSON
disagree. So a figure changes in one place: rerun this, then `--docs`.

Usage: python benchmarks/example_figures.py [--only grpo-tiny-arithmetic,cartpole-ppo] [--seeds 0,1,2]
       python benchmarks/example_figures.py --docs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "examples.json"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = {
    "grpo-tiny-arithmetic": ("examples/grpo-tiny-arithmetic.yaml", [0, 1, 2]),
    "cartpole-ppo": ("examples/cartpole-ppo.yaml", [1, 2, 3]),
    "grpo-tiny-calculator": ("examples/grpo-tiny-calculator.yaml", [0]),
    "grpo-vlm-tiny-shapes": ("examples/grpo-vlm-tiny-shapes.yaml", [0]),
    "minigrid-pixels-ppo": ("examples/minigrid-pixels-ppo.yaml", [1, 2, 3]),
    "metaworld-reach-ppo": ("examples/metaworld-reach-ppo.yaml", [1, 2]),
    "vla-tiny": ("examples/vla-tiny.yaml", [1, 2, 3]),
}
"""Example name -> (manifest, default seeds). cartpole-ppo, minigrid-pixels-ppo and vla-tiny ship with seed 1, the
others with seed 0."""
HEALTH_CONDITIONS = ("EntropyCollapsed", "MismatchHigh", "Stalled")
WINDOW = 10
MARKED = re.compile(r"<!-- figure: (?P<key>[\w.-]+) -->(?P<body>.*?)<!-- /figure -->", re.DOTALL)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run's metrics.jsonl."""
    accuracy = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    held_out = [r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None]
    returns = [x for r in records for x in r.get("episode_returns") or []]
    entropy = [r["entropy"] for r in records if r.get("entropy") is not None]
    success = [r["success_rate"] for r in records if r.get("success_rate") is not None]
    return {
        "steps": records[-1]["step"] if records else 0,
        "training_s": round(records[-1]["wall_time"], 1) if records else None,
        "accuracy_first": mean(accuracy[:WINDOW]),
        "accuracy_last": mean(accuracy[-WINDOW:]),
        "held_out_first": held_out[0] if held_out else None,
        "held_out_last": held_out[-1] if held_out else None,
        "return_first_20": mean(returns[:20]),
        "return_last_20": mean(returns[-20:]),
        "entropy_min": min(entropy) if entropy else None,
        "success_first": mean(success[:WINDOW]),
        "success_last": mean(success[-WINDOW:]),
    }


def run_example(manifest: str, seed: int, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{Path(manifest).stem}-seed{seed}"
    command = [sys.executable, "-m", "rljob.cli.main", "run", manifest, "--quiet", "--out", str(out)]
    command += ["--set", f"spec.trainer.seed={seed}"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{manifest} seed {seed} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    flagged = sorted({c for c in HEALTH_CONDITIONS if re.search(rf"^{c}\b", done.stderr, re.MULTILINE)})
    summary = summarise(records)
    summary |= {"seed": seed, "wall_s": round(wall, 1), "health_flagged": flagged}
    summary["result_lines"] = [line for line in done.stdout.splitlines() if not re.match(r"(\w+):\s+/", line)]
    return summary


def measure(names: list[str], seeds: list[int] | None) -> dict[str, Any]:
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"examples": {}}
    with tempfile.TemporaryDirectory(prefix="rljob-figures-") as tmp:
        for name in names:
            manifest, default_seeds = EXAMPLES[name]
            runs = []
            for seed in seeds if seeds is not None else default_seeds:
                print(f"{name} seed {seed} ...", file=sys.stderr, flush=True)
                runs.append(run_example(manifest, seed, Path(tmp)))
                print(f"  {json.dumps({k: v for k, v in runs[-1].items() if k != 'result_lines'})}", file=sys.stderr)
            results["examples"][name] = {
                "manifest": manifest,
                "runs": runs,
                "measured": time.strftime("%Y-%m-%d"),
                "cpus": os.cpu_count(),
                # The 15-minute load average at the end: above `cpus`, other work shared the cores and the
                # seconds are longer than on a quiet machine.
                "load_average": round(os.getloadavg()[2], 1),
            }
    return results


def _runs(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return results["examples"][name]["runs"]


def _span(values: list[float], digits: int) -> str:
    low, high = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return low if low == high else f"{low}\u2013{high}"


def _seeds(runs: list[dict[str, Any]]) -> str:
    seeds = [r["seed"] for r in runs]
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {min(seeds)}\u2013{max(seeds)}"


def render_figure(key: str, results: dict[str, Any]) -> str:
    """The text a docs span marked `key` holds."""
    name, _, what = key.rpartition(".")
    runs = _runs(results, name)
    first = runs[0]
    if what == "result":  # what `rljob run` prints for the example's own seed (its paths left out)
        command = f"$ .venv/bin/rljob run {results['examples'][name]['manifest']}"
        return "\n```console\n" + "\n".join([command, "...", *first["result_lines"]]) + "\n```\n"
    if what == "held-out":
        return (
            f"held-out accuracy {_span([r['held_out_first'] for r in runs], 2)} → "
            f"{_span([r['held_out_last'] for r in runs], 2)} ({_seeds(runs)})"
        )
    if what == "accuracy":
        return (
            f"training accuracy {_span([r['accuracy_first'] for r in runs], 2)} → "
            f"{_span([r['accuracy_last'] for r in runs], 2)} ({_seeds(runs)})"
        )
    if what == "training-time":
        example = results["examples"][name]
        shared = (
            f", shared (load average {example['load_average']})" if example["load_average"] > example["cpus"] else ""
        )
        return f"{_span([r['training_s'] for r in runs], 0)} s of training on {example['cpus']} CPU cores{shared}"
    if what == "return-rise":  # the mean return of the first 20 episodes -> of the last 20
        return (
            f"{_span([r['return_first_20'] for r in runs], 2)} → {_span([r['return_last_20'] for r in runs], 2)} "
            f"({_seeds(runs)})"
        )
    if what == "success":
        return (
            f"success rate {_span([r['success_first'] for r in runs], 2)} → "
            f"{_span([r['success_last'] for r in runs], 2)} ({_seeds(runs)})"
        )
    if what == "return":
        return f"{_span([r['return_last_20'] for r in runs], 1)} ({_seeds(runs)})"
    raise KeyError(f"no figure {what!r} (in {key!r})")


def marked_spans(text: str) -> list[tuple[str, str]]:
    """(key, body) of every marked span of a page."""
    return [(m["key"], m["body"]) for m in MARKED.finditer(text)]


def rewrite(text: str, results: dict[str, Any]) -> str:
    return MARKED.sub(
        lambda m: f"<!-- figure: {m['key']} -->{render_figure(m['key'], results)}<!-- /figure -->",
        text,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated examples (default all: {', '.join(EXAMPLES)})")
    parser.add_argument("--seeds", help="comma-separated seeds for every example (default: each example's own)")
    parser.add_argument("--docs", action="store_true", help="rewrite the docs' marked figures from the JSON, no run")
    args = parser.parse_args()
    if not args.docs:
        names = args.only.split(",") if args.only else list(EXAMPLES)
        unknown = sorted(set(names) - set(EXAMPLES))
        if unknown:
            parser.error(f"--only: unknown example(s) {unknown}; known: {', '.join(EXAMPLES)}")
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        results = measure(names, seeds)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    results = json.loads(RESULTS.read_text())
    for page in DOCS:
        text = page.read_text()
        new = rewrite(text, results)
        if new != text:
            page.write_text(new)
            print(f"rewrote the figures of {page.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
