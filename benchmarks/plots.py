"""The performance page's plots, drawn from the committed benchmark JSON at every docs build (an MkDocs hook).

Each plot is made from `benchmarks/results/*.json` by the benchmark's own plotting code into
`docs/assets/plots/` (not committed) before MkDocs collects the pages' files: a figure on a page and the plot
beside it come from the same file, so they cannot drift apart.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "docs" / "assets" / "plots"


def _benchmark(name: str) -> ModuleType:
    """A module of benchmarks/ by file name (the repository root is not on MkDocs' import path)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _steps_to_475(results: dict[str, Any], path: Path) -> None:
    """CartPole: env steps each seed needed to reach a mean return of 475, rljob beside stable-baselines3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    for row, (side, label) in enumerate((("rljob", "rljob local"), ("sb3", "stable-baselines3"))):
        steps = [s for s in results[side]["env_steps_to_475"]["per_seed"] if s is not None]
        ax.scatter(steps, [row] * len(steps), s=60, alpha=0.7, label=f"{label} ({len(steps)} seeds reached 475)")
        median = results[side]["env_steps_to_475"]["median"]
        if median is not None:
            ax.plot([median, median], [row - 0.3, row + 0.3], color="black", linewidth=2)
    ax.set_yticks([0, 1], ["rljob", "SB3"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("env steps to a mean return of 475 over the last 20 episodes (bar: median)")
    ax.set_title("PPO on CartPole-v1, same hyperparameters, one dot per seed")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw(out: Path = PLOTS) -> list[Path]:
    """Every plot, from the committed JSON; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    grpo = _benchmark("grpo_vs_trl")
    written = []
    for name, task in (("grpo_vs_trl", "tiny arithmetic"), ("grpo_vlm_vs_trl", "shapes (VLM)")):
        results = json.loads((RESULTS / f"{name}.json").read_text())
        grpo.plot(results["runs"], out / f"{name}.png", task=task)
        written.append(out / f"{name}.png")
    _steps_to_475(json.loads((RESULTS / "cartpole_vs_sb3.json").read_text()), out / "cartpole_vs_sb3.png")
    written.append(out / "cartpole_vs_sb3.png")
    return written


def on_pre_build(config: Any, **_: Any) -> None:
    draw()
