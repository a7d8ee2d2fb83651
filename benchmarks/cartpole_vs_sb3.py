"""rljob (local, envs in env-role processes) vs stable-baselines3 PPO on CartPole-v1, side by side.

Both run the hyperparameters of `examples/cartpole-ppo.yaml` (SB3's arguments are derived from the
manifest below), several seeds each, one after the other on this machine. For each run: wall time and
env steps until the mean return over the last 20 finished episodes reaches 475, and env steps/s.

Timing: SB3 from the start of `learn` (its envs and model already built); rljob from the start of the
actor's training loop (every role process started and connected; `wall_time` of metrics.jsonl). The
process start-up of rljob (python + torch imports of 4 processes) is reported separately as
`startup_s`, and `time_to_475_with_startup_s` includes it.

Usage: python benchmarks/cartpole_vs_sb3.py [--seeds 1 2 3] [--manifest examples/cartpole-ppo.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_rljob(manifest: Path, seed: int, workdir: Path) -> dict:
    out = workdir / f"rljob-seed{seed}"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob.cli.main",
            "run",
            str(manifest),
            "--out",
            str(out),
            "--quiet",
            "--set",
            f"spec.trainer.seed={seed}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    total = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"rljob run failed (seed {seed}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    points = [(r["wall_time"], r["env_steps"], r.get("episode_returns") or []) for r in records]
    crossing = first_crossing(points)
    loop_s = records[-1]["wall_time"]
    return {
        "time_to_475_s": crossing[0] if crossing else None,
        "env_steps_to_475": crossing[1] if crossing else None,
        "sps": records[-1]["env_steps"] / loop_s,
        "startup_s": total - loop_s,
        "final_return_last20": float(np.mean([x for r in records for x in r.get("episode_returns") or []][-WINDOW:])),
        "total_s": total,
        "curve": curve(points),
    }


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
    """One SB3 run in a fresh process (so torch threads and imports are set up like a user's script)."""
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
        self.t0 = time.perf_counter(); self.seen = 0
    def _on_rollout_end(self):
        pass
    def _on_step(self):
        for info in self.locals["infos"]:
            if "episode" in info:
                points.append((time.perf_counter() - self.t0, self.num_timesteps, [float(info["episode"]["r"])]))
        return True
cb = Track()
t0 = time.perf_counter()
model.learn(total_timesteps=s["total_timesteps"], callback=cb)
print(json.dumps({{"points": points, "total": time.perf_counter() - cb.t0, "steps": model.num_timesteps}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"sb3 run failed (seed {seed}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    points = [(t, n, r) for t, n, r in result["points"]]
    crossing = first_crossing(points)
    return {
        "time_to_475_s": crossing[0] if crossing else None,
        "env_steps_to_475": crossing[1] if crossing else None,
        "sps": result["steps"] / result["total"],
        "curve": curve(points),
    }


def summarise(runs: list[dict], extra: tuple[str, ...] = ()) -> dict:
    out = {
        "time_to_475_s": [r["time_to_475_s"] for r in runs],
        "env_steps_to_475": [r["env_steps_to_475"] for r in runs],
        "sps": statistics.median(r["sps"] for r in runs),
        "reached_475": sum(r["time_to_475_s"] is not None for r in runs),
    }
    for key in extra:
        out[key] = [round(r[key], 3) for r in runs]
    return out


def median_or_none(values: list[float | None]) -> float | None:
    """Median time to 475; a run that never got there counts as infinitely slow."""
    return statistics.median([v if v is not None else float("inf") for v in values]) if values else None


def plot(rljob_runs: list[dict], sb3_runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for runs, colour, label in ((rljob_runs, "tab:blue", "rljob local"), (sb3_runs, "tab:orange", "stable-baselines3")):
        for i, run in enumerate(runs):
            xs, ys = zip(*run["curve"], strict=True) if run["curve"] else ((), ())
            ax.plot(xs, ys, color=colour, alpha=0.8, label=label if i == 0 else None)
    ax.axhline(THRESHOLD, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"mean return, last {WINDOW} episodes")
    ax.set_title("CartPole-v1 PPO: rljob vs stable-baselines3 (same hyperparameters)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "cartpole-ppo.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = sb3_settings(args.manifest)
    rljob_runs, sb3_runs = [], []
    with tempfile.TemporaryDirectory(prefix="rljob-bench-") as tmp:
        for seed in args.seeds:
            # Interleaved, so that both see the same background load on a shared machine.
            rljob_runs.append(run_rljob(args.manifest, seed, Path(tmp)))
            print(f"rljob seed {seed}: {_fmt(rljob_runs[-1])}", flush=True)
            sb3_runs.append(run_sb3(settings, seed))
            print(f"sb3   seed {seed}: {_fmt(sb3_runs[-1])}", flush=True)
    rljob_median = median_or_none([r["time_to_475_s"] for r in rljob_runs])
    sb3_median = median_or_none([r["time_to_475_s"] for r in sb3_runs])
    with_startup = [r["time_to_475_s"] + r["startup_s"] if r["time_to_475_s"] is not None else None for r in rljob_runs]
    result = {
        "rljob": {
            **summarise(rljob_runs, extra=("startup_s", "total_s", "final_return_last20")),
            "time_to_475_with_startup_s": with_startup,
        },
        "sb3": summarise(sb3_runs),
        "ratio_time_to_475": (rljob_median / sb3_median) if rljob_median and sb3_median else None,
        "ratio_time_to_475_with_startup": (
            median_or_none(with_startup) / sb3_median if sb3_median and median_or_none(with_startup) else None
        ),
        "settings": settings,
        "seeds": args.seeds,
        "timing": "sb3: from the start of learn(); rljob: from the start of the actor's training loop "
        "(all role processes up); rljob start-up is in startup_s",
        "machine": {"cpus": os.cpu_count()},
    }
    path = args.out / "cartpole_vs_sb3.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(rljob_runs, sb3_runs, args.out / "cartpole_vs_sb3.png")
    print(json.dumps({k: result[k] for k in ("rljob", "sb3", "ratio_time_to_475")}, indent=2))
    print(f"wrote {path} and {args.out / 'cartpole_vs_sb3.png'}")


def _fmt(run: dict) -> str:
    t = run["time_to_475_s"]
    return (
        f"time to 475 {t:.2f}s, {run['env_steps_to_475']} env steps, {run['sps']:.0f} steps/s"
        if t is not None
        else f"did not reach 475 ({run['sps']:.0f} steps/s)"
    )


if __name__ == "__main__":
    main()
