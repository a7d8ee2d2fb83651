"""Chaos soak: the tiny GRPO and CartPole examples run under `rljob run` while random faults hit their role
processes, beside the same job undisturbed (the peer: what the faults cost).

Faults, at `--rate` per minute (exponential gaps, seeded): SIGKILL or SIGTERM of a random live role process
(actor included: a SIGTERM to the actor is a preemption, checkpointed at the next step boundary; a SIGKILL
restarts the actor group from the last checkpoint), or a freeze (SIGSTOP, then SIGCONT after `--freeze-s`).

Reported per job (`benchmarks/results/chaos_soak.json`):
- steps_lost: steps missing from the final metrics.jsonl (must be 0);
- steps_repeated: steps trained again after a restart (the actor resumed from a checkpoint older than the last
  step it had reached: a SIGKILL between checkpoints; 0 for preemptions);
- restarts and replacements, as the launcher logged them;
- recover_s median and p99: from a fault to the first step past the one it hit;
- whole: the run ended by itself with exit 0 and metrics.jsonl holds every step once, in order.

Not in this soak: link cuts (they need network namespaces: tests/multihost) and operator kills (no operator in a
local run: tests/operator/controller covers an operator restart mid-job). Those are named in the JSON.

    python benchmarks/chaos_soak.py                  # both jobs, defaults below
    python benchmarks/chaos_soak.py --jobs cartpole --rate 6 --seed 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "chaos_soak.json"

JOBS: dict[str, tuple[str, list[str]]] = {
    # Two rollout and two reward replicas: a frozen or killed one leaves another to take its work.
    "grpo": (
        "examples/grpo-tiny-arithmetic.yaml",
        [
            "spec.trainer.steps=300",
            "spec.checkpoint.interval=20",
            "spec.evaluation.interval=0",
            "spec.roles.rollout.replicas=2",
            "spec.roles.reward.replicas=2",
        ],
    ),
    "cartpole": (
        "examples/cartpole-ppo.yaml",
        ["spec.trainer.steps=600", "spec.checkpoint.interval=20", "spec.roles.env.replicas=2"],
    ),
}
COMMON = [
    "spec.failurePolicy.maxRestarts=1000",
    "spec.failurePolicy.maxReplacements=1000",
    "spec.logging.tensorboard=false",
]
FAULTS = ("sigkill", "sigterm", "freeze")


@dataclass
class Fault:
    at_s: float
    kind: str
    target: str
    step: int
    recover_s: float | None = None


@dataclass
class Watch:
    """metrics.jsonl followed as it grows (and shrinks: a resumed actor cuts it back to its checkpoint)."""

    path: Path
    highest: int = 0
    repeated: int = 0
    last: int = 0
    cuts: list[tuple[int, int]] = field(default_factory=list)

    def poll(self) -> int:
        steps = read_steps(self.path)
        last = steps[-1] if steps else 0
        if last < self.last:  # cut back: every step past `last` that was reached will be trained again
            self.cuts.append((self.highest, last))
            self.repeated += self.highest - last
            self.highest = last
        self.last = last
        self.highest = max(self.highest, last)
        return last


def read_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue  # a line being written
    return steps


def role_processes(out: Path) -> dict[str, psutil.Process]:
    """Each live role replica's own process (`rljob role ...`), not its children (engine workers, sandboxes)."""
    found = {}
    for process in psutil.process_iter():
        try:
            env = process.environ()
            command = process.cmdline()
            if (
                env.get("RLJOB_RUN_DIR") == str(out)
                and env.get("RLJOB_ROLE")
                and "rljob.cli.main" in command
                and "role" in command
                and process.status() not in ("zombie", "stopped")
            ):
                found[f"{env['RLJOB_ROLE']}-{env.get('RLJOB_REPLICA', '0')}"] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def start(example: str, out: Path, overrides: list[str]) -> subprocess.Popen[str]:
    sets = [f"--set={o}" for o in [*overrides, *COMMON]]
    command = [sys.executable, "-m", "rljob.cli.main", "run", str(REPO / example), "--out", str(out), "--quiet", *sets]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def soak(name: str, rate: float, freeze_s: float, seed: int, work: Path, limit_s: float, faults_on: bool) -> dict:
    example, overrides = JOBS[name]
    out = work / f"{name}-{'chaos' if faults_on else 'calm'}"
    rng = random.Random(seed)
    steps_wanted = int(next(o for o in overrides if o.startswith("spec.trainer.steps=")).split("=")[1])
    started = time.monotonic()
    run = start(example, out, overrides)
    watch = Watch(out / "metrics.jsonl")
    faults: list[Fault] = []
    next_fault = started + rng.expovariate(rate / 60) if faults_on else float("inf")
    while run.poll() is None and time.monotonic() - started < limit_s:
        step = watch.poll()
        now = time.monotonic()
        for fault in faults:
            if fault.recover_s is None and step > fault.step:
                fault.recover_s = now - started - fault.at_s
        if now >= next_fault and 0 < step < steps_wanted - 5:
            live = role_processes(out)
            if live:
                target = rng.choice(sorted(live))
                kind = rng.choice(FAULTS)
                fault = Fault(round(now - started, 2), kind, target, step)
                faults.append(fault)
                process = live[target]
                try:
                    if kind == "sigkill":
                        process.send_signal(signal.SIGKILL)
                    elif kind == "sigterm":
                        process.send_signal(signal.SIGTERM)
                    else:
                        process.send_signal(signal.SIGSTOP)
                        time.sleep(freeze_s)
                        process.send_signal(signal.SIGCONT)
                except psutil.NoSuchProcess:
                    fault.kind += " (already gone)"
            next_fault = time.monotonic() + rng.expovariate(rate / 60)
        time.sleep(0.2)
    timed_out = run.poll() is None
    if timed_out:
        run.send_signal(signal.SIGINT)
    output = run.communicate(timeout=120)[0] or ""
    watch.poll()
    seconds = time.monotonic() - started
    steps = read_steps(out / "metrics.jsonl")
    recovered = [f.recover_s for f in faults if f.recover_s is not None]
    return {
        "job": name,
        "example": example,
        "overrides": [*overrides, *COMMON],
        "faults_on": faults_on,
        "exit_code": run.returncode,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
        "steps_wanted": steps_wanted,
        "steps_recorded": len(steps),
        "steps_lost": len(set(range(1, steps_wanted + 1)) - set(steps)),
        "steps_repeated": watch.repeated,
        "whole": run.returncode == 0 and steps == list(range(1, steps_wanted + 1)),
        "faults": len(faults),
        "faults_by_kind": {kind: sum(f.kind == kind for f in faults) for kind in FAULTS},
        "restarts": len(re.findall(r"restarting the actor group", output)),
        "preemptions": len(re.findall(r"exited with code 75 \(preempted", output)),
        "replacements": len(re.findall(r"exited with code .*: replacing it", output)),
        "recover_s_median": round(statistics.median(recovered), 2) if recovered else None,
        "recover_s_p99": round(percentile(recovered, 0.99), 2) if recovered else None,
        "not_recovered": sum(f.recover_s is None for f in faults),
        "fault_log": [vars(f) for f in faults],
        "output_tail": output.splitlines()[-8:],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS))
    parser.add_argument("--rate", type=float, default=10.0, help="faults per minute")
    parser.add_argument("--freeze-s", type=float, default=8.0, help="how long a frozen process stays stopped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=1200.0, help="a run still going after this is stopped")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rljob-soak-") as tmp:
        for name in args.jobs:
            for faults_on in (False, True):
                result = soak(name, args.rate, args.freeze_s, args.seed, Path(tmp), args.limit_s, faults_on)
                print(json.dumps({k: v for k, v in result.items() if k not in ("fault_log", "output_tail")}))
                results.append(result)
    report = {
        "benchmark": "chaos soak: random SIGKILL / SIGTERM / freeze of role processes under `rljob run`",
        "peer": "the same job undisturbed, in the same run on the same machine",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"rate_per_minute": args.rate, "freeze_s": args.freeze_s, "seed": args.seed},
        "not_covered": [
            "link cuts: need network namespaces (tests/multihost covers a cut link)",
            "operator kills: no operator in a local run (tests/operator/controller covers an operator restart)",
        ],
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
