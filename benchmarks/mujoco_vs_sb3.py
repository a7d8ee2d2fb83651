"""rljob (`rljob run`, MuJoCo stepped in an env-role process) vs stable-baselines3 PPO on Hopper-v5 and HalfCheetah-v5.

Both sides run the settings of `examples/ppo-hopper.yaml` (SB3's arguments derived from the manifest as in
cartpole_vs_sb3.py), for the same number of env steps, on the same cores, with torch on one thread. The
environment pipeline is the same on both sides: gymnasium's `NormalizeObservation` and `NormalizeReward`
wrappers inside each environment, as the manifest's `spec.task.gym.wrappers` puts them in the env role (SB3:
`make_vec_env(wrapper_class=...)`, with SB3's `Monitor` innermost, so that its episode returns are Hopper's own,
as rljob reports them). Runs are interleaved per seed so that both sides see the same background load.

Per run: the mean return of the last 20 episodes at the end (`final_return`), env steps, wall and CPU seconds.
Per side and env: mean and standard deviation of `final_return` over seeds, its range, and whether the two
sides' ranges overlap. The machine's load average at the start and the end is recorded.

Usage: python benchmarks/mujoco_vs_sb3.py [--seeds 3] [--env-steps 49152] [--envs Hopper-v5,HalfCheetah-v5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's rljob and benchmarks
    sys.path.insert(0, str(ROOT))

# The same measuring and manifest -> SB3 mapping as the CartPole benchmark.
from benchmarks.cartpole_vs_sb3 import measured, sb3_settings  # noqa: E402  (after the path fix above)

WINDOW = 20
RESULT = "mujoco_vs_sb3"


def final_return(returns: list[float]) -> float | None:
    return float(np.mean(returns[-WINDOW:])) if returns else None


def curve(points: list[tuple[int, list[float]]]) -> list[tuple[int, float]]:
    returns: list[float] = []
    out = []
    for steps, finished in points:
        returns.extend(finished)
        if finished:
            out.append((steps, round(float(np.mean(returns[-WINDOW:])), 2)))
    return out


def run_rljob(manifest: Path, env_id: str, updates: int, seed: int, workdir: Path) -> dict:
    out = workdir / f"rljob-{env_id}-seed{seed}"
    overrides = [f"spec.task.gym.envId={env_id}", f"spec.trainer.steps={updates}", f"spec.trainer.seed={seed}"]
    command = [sys.executable, "-m", "rljob.cli.main", "run", str(manifest), "--out", str(out), "--quiet"]
    for item in overrides:
        command += ["--set", item]
    proc, _, wall_s, cpu_s = measured(command)
    if proc.returncode != 0:
        raise RuntimeError(f"rljob run failed ({env_id}, seed {seed}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    points = [(r["env_steps"], r.get("episode_returns") or []) for r in records]
    returns = [x for _, finished in points for x in finished]
    return {
        "final_return": final_return(returns),
        "episodes": len(returns),
        "env_steps": records[-1]["env_steps"],
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "curve": curve(points),
    }


SB3_CODE = """
import json, sys, torch, gymnasium
from torch import nn
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
s, seed = json.loads(sys.argv[1]), int(sys.argv[2])
BUILTIN = {"normalize-observation": gymnasium.wrappers.NormalizeObservation,
           "normalize-reward": gymnasium.wrappers.NormalizeReward}
def wrap(env):
    for name, args in s["wrappers"]:
        env = BUILTIN[name](env, **args)
    return env
env = make_vec_env(s["env_id"], n_envs=s["n_envs"], seed=seed, wrapper_class=wrap)
lr = (lambda p: p * s["learning_rate"]) if s["linear_lr"] else s["learning_rate"]
act = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}[s["activation"]]
model = PPO("MlpPolicy", env, n_steps=s["n_steps"], batch_size=s["batch_size"], n_epochs=s["n_epochs"],
            gamma=s["gamma"], gae_lambda=s["gae_lambda"], clip_range=s["clip_range"], clip_range_vf=s["clip_range_vf"],
            ent_coef=s["ent_coef"], vf_coef=s["vf_coef"], max_grad_norm=s["max_grad_norm"] or 1e9, learning_rate=lr,
            normalize_advantage=s["normalize_advantage"], seed=seed, device="cpu",
            policy_kwargs=dict(net_arch=dict(pi=s["hidden_sizes"], vf=s["hidden_sizes"]), activation_fn=act,
                               optimizer_kwargs=dict(eps=s["adam_eps"])))
points = []
class Track(BaseCallback):
    def _on_step(self):
        finished = [float(info["episode"]["r"]) for info in self.locals["infos"] if "episode" in info]
        if finished:
            points.append((self.num_timesteps, finished))
        return True
model.learn(total_timesteps=s["total_timesteps"], callback=Track())
print(json.dumps({"points": points, "steps": model.num_timesteps}))
"""


def run_sb3(settings: dict, seed: int) -> dict:
    """One SB3 run in a fresh process, as a user's script would run it."""
    proc, _, wall_s, cpu_s = measured([sys.executable, "-c", SB3_CODE, json.dumps(settings), str(seed)])
    if proc.returncode != 0:
        raise RuntimeError(f"sb3 run failed ({settings['env_id']}, seed {seed}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    points = [(int(n), list(r)) for n, r in result["points"]]
    returns = [x for _, finished in points for x in finished]
    return {
        "final_return": final_return(returns),
        "episodes": len(returns),
        "env_steps": result["steps"],
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "curve": curve(points),
    }


def summarise(runs: list[dict]) -> dict:
    finals = [r["final_return"] for r in runs if r["final_return"] is not None]
    return {
        "final_return_mean": round(statistics.fmean(finals), 1) if finals else None,
        "final_return_std": round(statistics.stdev(finals), 1) if len(finals) > 1 else None,
        "final_return_range": [round(min(finals), 1), round(max(finals), 1)] if finals else None,
        "final_return_per_seed": [None if r["final_return"] is None else round(r["final_return"], 1) for r in runs],
        "env_steps": [r["env_steps"] for r in runs],
        "wall_s_mean": round(statistics.fmean(r["wall_s"] for r in runs), 1),
        "cpu_s_mean": round(statistics.fmean(r["cpu_s"] for r in runs), 1),
    }


def overlap(a: dict, b: dict) -> bool | None:
    if a["final_return_range"] is None or b["final_return_range"] is None:
        return None
    (lo_a, hi_a), (lo_b, hi_b) = a["final_return_range"], b["final_return_range"]
    return lo_a <= hi_b and lo_b <= hi_a


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = list(results)
    fig, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4.5), constrained_layout=True, squeeze=False)
    for ax, env_id in zip(axes[0], envs, strict=True):
        for side, colour, label in (("rljob", "tab:blue", "rljob local"), ("sb3", "tab:orange", "stable-baselines3")):
            for i, run in enumerate(results[env_id]["runs"][side]):
                if run["curve"]:
                    xs, ys = zip(*run["curve"], strict=True)
                    ax.plot(xs, ys, color=colour, alpha=0.7, label=label if i == 0 else None)
        ax.set_title(f"{env_id} PPO")
        ax.set_xlabel("env steps")
        ax.set_ylabel(f"mean return, last {WINDOW} episodes")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per side and env (default 3)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--env-steps", type=int, default=32768, help="env steps per run (whole PPO batches)")
    parser.add_argument("--envs", default="Hopper-v5,HalfCheetah-v5")
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "ppo-hopper.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    from rljob.api import load_job_file

    spec = load_job_file(args.manifest).spec
    assert spec.task.gym is not None
    updates = max(1, args.env_steps // spec.trainer.batch_size)
    wrappers = [[w.builtin, dict(w.args)] for w in spec.task.gym.wrappers]
    if any(name is None for name, _ in wrappers):
        parser.error("the manifest's wrappers must be builtins (the SB3 side builds them by name)")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    args.out.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    results: dict = {}
    settings_by_env: dict = {}
    path = args.out / f"{RESULT}.json"

    def write(complete: bool) -> None:
        """The JSON so far, after every run: a long benchmark stopped midway keeps what it measured."""
        output = {
            "complete": complete,
            "env_steps_per_run": updates * spec.trainer.batch_size,
            "seeds": seeds,
            "final_return": f"mean episode return (the env's own reward) of the last {WINDOW} episodes of a run",
            "results": results,
            "settings": settings_by_env,
            "machine": {
                "cpus": os.cpu_count(),
                "load_average_1_5_15_min_at_start": [round(x, 2) for x in load_at_start],
                "load_average_1_5_15_min_now": [round(x, 2) for x in os.getloadavg()],
            },
        }
        path.write_text(json.dumps(output, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="rljob-bench-") as tmp:
        for env_id in args.envs.split(","):
            settings_by_env[env_id] = {
                **sb3_settings(args.manifest),
                "env_id": env_id,
                "total_timesteps": updates * spec.trainer.batch_size,
                "wrappers": wrappers,
            }
            runs: dict[str, list[dict]] = {"rljob": [], "sb3": []}
            for seed in seeds:
                runs["rljob"].append(run_rljob(args.manifest, env_id, updates, seed, Path(tmp)))
                print(f"{env_id} rljob seed {seed}: {_fmt(runs['rljob'][-1])}", flush=True)
                runs["sb3"].append(run_sb3(settings_by_env[env_id], seed))
                print(f"{env_id} sb3   seed {seed}: {_fmt(runs['sb3'][-1])}", flush=True)
                summary = {side: summarise(side_runs) for side, side_runs in runs.items() if side_runs}
                results[env_id] = {
                    **summary,
                    "ranges_overlap": overlap(summary["rljob"], summary["sb3"]),
                    "runs": runs,
                }
                write(complete=False)
    write(complete=True)
    plot(results, args.out / f"{RESULT}.png")
    for env_id, result in results.items():
        for side in ("rljob", "sb3"):
            s = result[side]
            print(f"{env_id} {side}: {s['final_return_mean']} ± {s['final_return_std']} {s['final_return_range']}")
        print(f"{env_id} ranges overlap: {result['ranges_overlap']}")
    print(f"wrote {path} and {args.out / f'{RESULT}.png'}")


def _fmt(run: dict) -> str:
    return (
        f"final return {run['final_return']}, {run['episodes']} episodes, {run['env_steps']} env steps, "
        f"{run['wall_s']}s wall, {run['cpu_s']} CPU-s"
    )


if __name__ == "__main__":
    main()
