"""rljob (local, envs in env-role processes) vs stable-baselines3 PPO on CartPole-v1, side by side.

Both run the hyperparameters of `examples/cartpole-ppo.yaml` (SB3's arguments are derived from the
manifest), `--seeds N` seeds each (default 10), interleaved on this machine so that both sides see the same
background load. Per run and side:

- start-up: from just before the process is started to the start of learning, measured the same way for
  both (unix time stamps): SB3's `_on_training_start` (environments and model built), rljob's actor
  training loop (every role process started and connected; `timestamp - wall_time` of metrics.jsonl);
- time to 475 (from the start of learning, and from the process start) and env steps to 475: the first
  moment the mean return of the last 20 finished episodes reaches 475;
- env steps/s during learning; CPU seconds of the whole run, all processes of the side included (the
  rljob launcher, its role processes and their children; `resource.getrusage(RUSAGE_CHILDREN)`: every
  descendant is reaped by its parent before it returns) and wall time of the whole run.

Statistics: medians over seeds, with a distribution-free 95% confidence interval for each median from
order statistics (the binomial method: the widest symmetric pair of order statistics whose coverage is at
least 95%; the coverage achieved is written next to it). A run that never reaches 475 counts as infinitely
slow, which the order-statistic interval handles as it is. The ratio of medians (rljob / SB3) gets a
percentile-bootstrap 95% interval (10,000 resamples of the seeds of each side, fixed generator seed).
The machine's load average at the start and the end is recorded: on a shared machine both sides suffer
the same contention, but absolute figures move with it.

Usage: python benchmarks/cartpole_vs_sb3.py [--seeds 10] [--first-seed 1] [--manifest examples/cartpole-ppo.yaml]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
THRESHOLD = 475.0
WINDOW = 20
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000


def first_crossing(points: list[tuple[float, int, list[float]]]) -> tuple[float, int] | None:
    """(time, env steps) when the mean of the last WINDOW episode returns first reaches THRESHOLD."""
    returns: list[float] = []
    for t, steps, finished in points:
        returns.extend(finished)
        if len(returns) >= WINDOW and np.mean(returns[-WINDOW:]) >= THRESHOLD:
            return t, steps
    return None


def curve(points: list[tuple[float, int, list[float]]]) -> list[tuple[int, float]]:
    returns: list[float] = []
    out = []
    for _, steps, finished in points:
        returns.extend(finished)
        if returns:
            out.append((steps, float(np.mean(returns[-WINDOW:]))))
    return out


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every descendant of this process reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float, float, float]:
    """Run `command` to its end: (result, unix time just before its start, wall seconds, CPU seconds of it all)."""
    cpu_before = children_cpu_s()
    launched = time.time()
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return proc, launched, time.monotonic() - started, children_cpu_s() - cpu_before


def _run_figures(points, launched: float, learning_started: float, wall_s: float, cpu_s: float, steps: int) -> dict:
    crossing = first_crossing(points)
    startup = learning_started - launched
    learning_s = points[-1][0] if points else 0.0
    all_returns = [x for _, _, finished in points for x in finished]
    return {
        "startup_s": round(startup, 3),
        "time_to_475_s": round(crossing[0], 3) if crossing else None,
        "time_to_475_from_process_start_s": round(startup + crossing[0], 3) if crossing else None,
        "env_steps_to_475": crossing[1] if crossing else None,
        "env_steps": steps,
        "env_steps_per_s": round(steps / learning_s, 1) if learning_s > 0 else None,
        "cpu_s": round(cpu_s, 2),
        "wall_s": round(wall_s, 2),
        "final_return_last20": float(np.mean(all_returns[-WINDOW:])) if all_returns else None,
        "curve": curve(points),
    }


def run_rljob(manifest: Path, seed: int, workdir: Path) -> dict:
    out = workdir / f"rljob-seed{seed}"
    command = [sys.executable, "-m", "rljob.cli.main", "run", str(manifest), "--out", str(out), "--quiet"]
    proc, launched, wall_s, cpu_s = measured([*command, "--set", f"spec.trainer.seed={seed}"])
    if proc.returncode != 0:
        raise RuntimeError(f"rljob run failed (seed {seed}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    learning_started = records[0]["timestamp"] - records[0]["wall_time"]
    points = [(r["wall_time"], r["env_steps"], r.get("episode_returns") or []) for r in records]
    return _run_figures(points, launched, learning_started, wall_s, cpu_s, records[-1]["env_steps"])


def sb3_settings(manifest: Path) -> dict:
    from rljob.api import load_job_file

    spec = load_job_file(manifest).spec
    gym = spec.task.gym
    assert gym is not None
    n_steps = spec.trainer.batch_size // gym.num_envs
    return {
        "env_id": gym.env_id,
        "n_envs": gym.num_envs,
        "n_steps": n_steps,
        "batch_size": spec.trainer.batch_size // spec.algorithm.minibatches,
        "n_epochs": spec.algorithm.epochs,
        "gamma": spec.algorithm.gamma,
        "gae_lambda": spec.algorithm.gae_lambda,
        "clip_range": spec.algorithm.clip_ratio_low,
        "clip_range_vf": spec.algorithm.value_clip,
        "ent_coef": spec.algorithm.entropy_coef,
        # SB3's value loss is MSE, rljob's is 0.5 * MSE (CleanRL): the same weight is half the coefficient.
        "vf_coef": spec.algorithm.value_coef / 2,
        "max_grad_norm": spec.trainer.grad_clip,
        "learning_rate": spec.trainer.learning_rate,
        "linear_lr": spec.trainer.lr_schedule == "linear",
        "normalize_advantage": spec.algorithm.normalize_advantages,
        "hidden_sizes": list(spec.model.builtin.hidden_sizes),
        "activation": spec.model.builtin.activation,
        "adam_eps": spec.trainer.optimizer_eps,
        "total_timesteps": spec.trainer.steps * spec.trainer.batch_size,
    }


def run_sb3(settings: dict, seed: int) -> dict:
    """One SB3 run in a fresh process (so imports and torch threads are set up like a user's script)."""
    code = f"""
import json, time, torch
from torch import nn
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
s = json.loads({json.dumps(json.dumps(settings))})
env = make_vec_env(s["env_id"], n_envs=s["n_envs"], seed={seed})
lr = (lambda p: p * s["learning_rate"]) if s["linear_lr"] else s["learning_rate"]
act = {{"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}}[s["activation"]]
model = PPO("MlpPolicy", env, n_steps=s["n_steps"], batch_size=s["batch_size"], n_epochs=s["n_epochs"],
            gamma=s["gamma"], gae_lambda=s["gae_lambda"], clip_range=s["clip_range"], clip_range_vf=s["clip_range_vf"],
            ent_coef=s["ent_coef"], vf_coef=s["vf_coef"], max_grad_norm=s["max_grad_norm"] or 1e9, learning_rate=lr,
            normalize_advantage=s["normalize_advantage"], seed={seed}, device="cpu",
            policy_kwargs=dict(net_arch=dict(pi=s["hidden_sizes"], vf=s["hidden_sizes"]), activation_fn=act,
                               optimizer_kwargs=dict(eps=s["adam_eps"])))
points = []
class Track(BaseCallback):
    def _on_training_start(self):
        self.started = time.time(); self.t0 = time.perf_counter()
    def _on_step(self):
        for info in self.locals["infos"]:
            if "episode" in info:
                points.append((time.perf_counter() - self.t0, self.num_timesteps, [float(info["episode"]["r"])]))
        return True
cb = Track()
model.learn(total_timesteps=s["total_timesteps"], callback=cb)
print(json.dumps({{"points": points, "started": cb.started, "total": time.perf_counter() - cb.t0,
                  "steps": model.num_timesteps}}))
"""
    proc, launched, wall_s, cpu_s = measured([sys.executable, "-c", code])
    if proc.returncode != 0:
        raise RuntimeError(f"sb3 run failed (seed {seed}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    points = [(t, n, r) for t, n, r in result["points"]]
    points.append((result["total"], result["steps"], []))  # learning time runs to the last update
    return _run_figures(points, launched, result["started"], wall_s, cpu_s, result["steps"])


# --- statistics --------------------------------------------------------------------------------


def median_ci(values: list[float | None]) -> dict:
    """Median and distribution-free CONFIDENCE interval from order statistics; None counts as +infinity.

    For n samples the interval [x_(j), x_(n+1-j)] covers the median with probability
    sum_{i=j}^{n-j} C(n, i) / 2^n; j is the largest that keeps it >= CONFIDENCE.
    """
    xs = sorted(math.inf if v is None else float(v) for v in values)
    n = len(xs)
    median = statistics.median(xs)
    best = None
    for j in range(1, n // 2 + 1):
        coverage = sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2**n
        if coverage >= CONFIDENCE:
            best = (j, coverage)
    out: dict = {"median": _finite(median), "n": n}
    if best is None:
        out.update(ci=None, ci_note=f"{n} samples are too few for a {CONFIDENCE:.0%} order-statistic interval")
    else:
        j, coverage = best
        out.update(ci=[_finite(xs[j - 1]), _finite(xs[n - j])], ci_coverage=round(coverage, 4))
    return out


def ratio_of_medians_ci(numerator: list[float | None], denominator: list[float | None]) -> dict:
    """Ratio of the medians with a percentile-bootstrap CONFIDENCE interval (seeds resampled per side)."""
    a = np.array([math.inf if v is None else v for v in numerator], dtype=float)
    b = np.array([math.inf if v is None else v for v in denominator], dtype=float)
    point = float(np.median(a) / np.median(b))
    rng = np.random.default_rng(0)
    ratios = np.median(rng.choice(a, (BOOTSTRAP_RESAMPLES, len(a))), axis=1) / np.median(
        rng.choice(b, (BOOTSTRAP_RESAMPLES, len(b))), axis=1
    )
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.nanpercentile(ratios, [tail, 100 - tail])
    return {"ratio": _finite(point), "ci": [_finite(float(low)), _finite(float(high))]}


def _finite(x: float) -> float | None:
    return None if not math.isfinite(x) else round(x, 3)


STATISTICS = (
    "startup_s",
    "time_to_475_s",
    "time_to_475_from_process_start_s",
    "env_steps_to_475",
    "env_steps_per_s",
    "cpu_s",
    "wall_s",
)


def summarise(runs: list[dict]) -> dict:
    out: dict = {"reached_475": sum(r["time_to_475_s"] is not None for r in runs)}
    for key in STATISTICS:
        out[key] = {**median_ci([r[key] for r in runs]), "per_seed": [r[key] for r in runs]}
    out["final_return_last20"] = [r["final_return_last20"] for r in runs]
    return out


def plot(rljob_runs: list[dict], sb3_runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for runs, colour, label in ((rljob_runs, "tab:blue", "rljob local"), (sb3_runs, "tab:orange", "stable-baselines3")):
        for i, run in enumerate(runs):
            xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
            ax.plot(xs, ys, color=colour, alpha=0.6, label=label if i == 0 else None)
    ax.axhline(THRESHOLD, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"mean return, last {WINDOW} episodes")
    ax.set_title(f"CartPole-v1 PPO: rljob vs stable-baselines3 (same hyperparameters, {len(runs)} seeds each)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds per side (default 10)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "cartpole-ppo.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    settings = sb3_settings(args.manifest)
    load_at_start = os.getloadavg()
    rljob_runs, sb3_runs = [], []
    with tempfile.TemporaryDirectory(prefix="rljob-bench-") as tmp:
        for seed in seeds:
            # Interleaved, so that both see the same background load on a shared machine.
            rljob_runs.append(run_rljob(args.manifest, seed, Path(tmp)))
            print(f"rljob seed {seed}: {_fmt(rljob_runs[-1])}", flush=True)
            sb3_runs.append(run_sb3(settings, seed))
            print(f"sb3   seed {seed}: {_fmt(sb3_runs[-1])}", flush=True)
    load_at_end = os.getloadavg()
    result = {
        "rljob": summarise(rljob_runs),
        "sb3": summarise(sb3_runs),
        "ratios_rljob_over_sb3": {
            key: ratio_of_medians_ci([r[key] for r in rljob_runs], [r[key] for r in sb3_runs])
            for key in ("time_to_475_s", "time_to_475_from_process_start_s", "env_steps_to_475", "cpu_s", "startup_s")
        },
        "statistics": f"medians over seeds; ci: distribution-free {CONFIDENCE:.0%} interval for the median from "
        "order statistics (binomial method, coverage achieved in ci_coverage; a run that never reached 475 "
        f"counts as +infinity, shown as null); ratios: ratio of medians with a percentile-bootstrap "
        f"{CONFIDENCE:.0%} interval ({BOOTSTRAP_RESAMPLES} resamples per side)",
        "timing": "startup_s: unix time from just before the process starts to the start of learning (sb3: "
        "_on_training_start of learn(); rljob: the actor's training loop, all role processes up); time_to_475_s "
        "from the start of learning; cpu_s: user + system CPU of every process of the run (rljob: launcher, "
        "role processes and their children), from getrusage(RUSAGE_CHILDREN); wall_s: the whole run",
        "settings": settings,
        "seeds": seeds,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1_5_15_min_at_start": [round(x, 2) for x in load_at_start],
            "load_average_1_5_15_min_at_end": [round(x, 2) for x in load_at_end],
        },
    }
    path = args.out / "cartpole_vs_sb3.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(rljob_runs, sb3_runs, args.out / "cartpole_vs_sb3.png")
    print(json.dumps({k: result[k] for k in ("ratios_rljob_over_sb3", "machine")}, indent=1))
    for side in ("rljob", "sb3"):
        print(side, {k: (v["median"], v.get("ci")) for k, v in result[side].items() if isinstance(v, dict)})
    print(f"wrote {path} and {args.out / 'cartpole_vs_sb3.png'}")


def _fmt(run: dict) -> str:
    t = run["time_to_475_s"]
    reached = f"time to 475 {t:.2f}s, {run['env_steps_to_475']} env steps" if t is not None else "did not reach 475"
    return (
        f"start-up {run['startup_s']:.2f}s, {reached}, {run['env_steps_per_s']} steps/s, "
        f"{run['cpu_s']:.1f} CPU-s, {run['wall_s']:.1f}s wall"
    )


if __name__ == "__main__":
    main()
