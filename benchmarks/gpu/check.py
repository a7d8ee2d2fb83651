"""One command that verifies the GPU path on a machine with an NVIDIA GPU: `make gpu-check`.

Made for a GPU machine that has python3 with a CUDA build of torch and transformers preinstalled but no package
registry: the project's other dependencies come along as wheels (`make gpu-wheels`, run beforehand on a machine
with registry access, writes them to build/gpu-wheels), which this script unpacks into build/gpu-site and puts on
PYTHONPATH together with the repository. Then, each bounded in time (under 10 minutes in all):

1. the machine: torch, CUDA, the device;
2. the `cuda`-marked tests (tests/gpu: the actor's update on CUDA against the CPU's, bf16, a CUDA actor's weight
   broadcast; the weight sync between CUDA tensors on one GPU, which goes by gloo: NCCL refuses two ranks on one
   GPU, so its NCCL rounds need a second GPU and skip here, saying so);
3. `examples/cartpole-ppo.yaml` with the actor on the GPU (gpusPerReplica 1): the return it reaches;
4. `examples/grpo-tiny-arithmetic.yaml` with the actor on the GPU (the hf rollout on the CPU: one GPU cannot hold
   two replicas' ranks): its accuracy, held-out accuracy and step time;
5. the same example collocated (`roles.rollout.collocated`, `weightSync.method: ipc`): actor and hf rollout share
   the one GPU, weights pass by CUDA IPC handles and the rollout sleeps (weights to the CPU) while the actor
   trains: its accuracy, its largest rollout/trainer log-prob gap (the weights arrived whole) and step time;
6. `benchmarks/grpo_vs_trl.py --device cuda` (100 steps, seed 0): rljob collocated against TRL's GRPOTrainer on
   the same GPU, same model, prompts and settings: completions/s of each, their ratio, seconds to 50% training
   accuracy, the update's share of the GPU's fp32 matmul roof (its JSON and plot under OUT/grpo_vs_trl/).

Everything lands in OUT/check.json (figures and pass/fail per part) and OUT/check.log (every line printed).
The exit code is 0 only when every part passed on a CUDA device. `--allow-cpu` runs the same parts without a GPU
(CUDA tests skip, roles on the CPU): how the wheel set is checked on a CPU machine before a GPU one is at hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOTAL_LIMIT_S = 570.0
"""The whole check's budget: a part gets its own limit or what is left of this, whichever is less."""
COLLOCATED = ["spec.roles.rollout.collocated=true", "spec.rollout.weightSync.method=ipc"]

PROBE = """
import json, torch, transformers
cuda = torch.cuda.is_available()
print(json.dumps({
    "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "transformers": transformers.__version__,
    "cuda": cuda, "devices": torch.cuda.device_count() if cuda else 0,
    "device": torch.cuda.get_device_name(0) if cuda else None,
    "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
    "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
}))
"""


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
    """Unpack every wheel under `wheels` into `site` (a wheel is a zip of its import tree); their file names."""
    names = sorted(p.name for p in wheels.glob("*.whl"))
    stamp = site / ".wheels"
    if stamp.exists() and stamp.read_text() == "\n".join(names):
        return names
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for name in names:
        with zipfile.ZipFile(wheels / name) as wheel:
            wheel.extractall(site)
    stamp.write_text("\n".join(names))
    return names


class Check:
    """Runs the parts, each in a child process with a time limit, and keeps every line and figure."""

    def __init__(self, out: Path, env: dict[str, str], budget_s: float = TOTAL_LIMIT_S) -> None:
        self.out = out
        self.env = env
        self.deadline = time.monotonic() + budget_s
        self.log = (out / "check.log").open("w")
        self.parts: dict[str, dict[str, Any]] = {}

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, part: str, command: list[str], limit_s: float) -> tuple[bool, str, float]:
        """Run `command` from the repository root; (exit 0 within the limit, its output, seconds)."""
        started = time.monotonic()
        limit_s = max(1.0, min(limit_s, self.deadline - started))  # every part within the whole check's budget
        self.say(f"== {part}: {' '.join(command)}")
        try:
            done = subprocess.run(
                command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=limit_s, check=False
            )
            output, ok = done.stdout + done.stderr, done.returncode == 0
            verdict = f"exit {done.returncode}"
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
            ok, verdict = False, f"over its {limit_s:.0f}s limit"
        seconds = time.monotonic() - started
        for line in output.splitlines():
            self.log.write(f"  {line}\n")
        self.say(f"== {part}: {verdict} in {seconds:.1f}s")
        return ok, output, seconds

    def record(self, part: str, ok: bool, seconds: float, **figures: Any) -> None:
        self.parts[part] = {"ok": ok, "seconds": round(seconds, 1), **figures}


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return round(statistics.fmean(values), 4) if values else None


def median_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return round(statistics.median(values), 5) if values else None


def rljob_run(check: Check, part: str, example: str, gpus: int, limit_s: float, sets: list[str]) -> list[dict]:
    run_dir = check.out / part
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "rljob.cli.main", "run", f"examples/{example}", "--out", str(run_dir), "--quiet"]
    for value in [f"spec.roles.actor.gpusPerReplica={gpus}", *sets]:
        command += ["--set", value]
    ok, _, seconds = check.run(part, command, limit_s)
    records = metrics(run_dir)
    check.record(part, ok, seconds, steps=len(records))
    return records


def grpo_vs_trl(check: Check, on_gpu: bool) -> None:
    """Part 6: the GRPO benchmark on the GPU (on the CPU with --allow-cpu), its summary figures kept."""
    out = check.out / "grpo_vs_trl"
    command = [sys.executable, "benchmarks/grpo_vs_trl.py", "--sides", "rljob_hf,trl", "--steps", "100"]
    command += ["--seeds", "0", "--device", "cuda" if on_gpu else "cpu", "--out", str(out)]
    ok, _, seconds = check.run("grpo_vs_trl", command, 240)
    report = out / "grpo_vs_trl.json"
    summary = json.loads(report.read_text())["summary"] if ok and report.exists() else {}
    check.record(
        "grpo_vs_trl",
        ok and bool(summary),
        seconds,
        **{
            side: {
                "completions_per_s": round(figures["completions_per_s"]["mean"], 1),
                "heldout_greedy_accuracy": figures["heldout_greedy_accuracy"]["mean"],
                "seconds_to_accuracy_0.5": figures["seconds_to_accuracy_0.5"].get("mean"),
                "update_share_of_roof": (figures["update_share_of_roof"] or {}).get("mean"),
                **(
                    {"ratio_vs_trl": round(figures["ratio_completions_per_s_vs_trl"]["mean"], 3)}
                    if "ratio_completions_per_s_vs_trl" in figures
                    else {}
                ),
            }
            for side, figures in summary.items()
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    parser.add_argument("--wheels", type=Path, default=REPO / "build" / "gpu-wheels")
    parser.add_argument("--site", type=Path, default=REPO / "build" / "gpu-site")
    parser.add_argument("--allow-cpu", action="store_true", help="run every part without a GPU (a wheel-set check)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    env = dict(os.environ)
    wheels = unpack_wheels(args.wheels, args.site) if args.wheels.is_dir() else []
    env["PYTHONPATH"] = os.pathsep.join(
        [str(args.site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])] if wheels else [str(REPO)]
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    check = Check(args.out, env)
    started = time.monotonic()
    check.say(f"rljob gpu-check, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {len(wheels)} wheels")

    ok, output, seconds = check.run("machine", [sys.executable, "-c", PROBE], 120)
    machine = json.loads(output.strip().splitlines()[-1]) if ok else {}
    machine.update(python=platform.python_version(), host=platform.node(), cpus=os.cpu_count())
    check.record("machine", ok, seconds, **machine)
    on_gpu = bool(machine.get("cuda"))
    if not on_gpu and not args.allow_cpu:
        check.say("no CUDA device here: run `make gpu-check` on an NVIDIA GPU machine (--allow-cpu: parts on CPU)")
    if ok and (on_gpu or args.allow_cpu):
        junit = args.out / "cuda-tests.xml"
        tests = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
        ok, _, seconds = check.run("cuda_tests", [*tests, f"--junitxml={junit}"], 240)
        suite = ET.parse(junit).getroot().find("testsuite") if junit.exists() else None
        keys = ("tests", "failures", "errors", "skipped")
        counts = {k: int(suite.get(k, 0)) for k in keys} if suite is not None else {}
        check.record("cuda_tests", ok and bool(counts), seconds, **counts)

        gpus = 1 if on_gpu else 0
        records = rljob_run(check, "cartpole", "cartpole-ppo.yaml", gpus, 200, [])
        check.parts["cartpole"].update(return_last10=mean_of(records[-10:], "return_mean"))

        records = rljob_run(check, "grpo_tiny", "grpo-tiny-arithmetic.yaml", gpus, 240, [])
        evals = [r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None]
        check.parts["grpo_tiny"].update(
            accuracy_first10=mean_of(records[:10], "accuracy"),
            accuracy_last10=mean_of(records[-10:], "accuracy"),
            eval_accuracy_last=evals[-1] if evals else None,
            step_s_median={k: median_of(records, f"time_{k}_s") for k in ("generate", "reward", "train", "sync")},
        )

        records = rljob_run(check, "grpo_tiny_collocated", "grpo-tiny-arithmetic.yaml", gpus, 240, COLLOCATED)
        check.parts["grpo_tiny_collocated"].update(
            accuracy_first10=mean_of(records[:10], "accuracy"),
            accuracy_last10=mean_of(records[-10:], "accuracy"),
            mismatch_max_gap_max=max((r["mismatch_max_gap"] for r in records), default=None),
            step_s_median={k: median_of(records, f"time_{k}_s") for k in ("generate", "reward", "train", "sync")},
        )

        grpo_vs_trl(check, on_gpu)

    passed = on_gpu and all(part["ok"] for part in check.parts.values()) and len(check.parts) == 6
    summary = {
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}",
        "passed": passed,
        "on_gpu": on_gpu,
        "seconds": round(time.monotonic() - started, 1),
        "wheels": wheels,
        "parts": check.parts,
    }
    (args.out / "check.json").write_text(json.dumps(summary, indent=1) + "\n")
    check.say(f"{'PASSED' if passed else 'NOT PASSED'}: {args.out / 'check.json'} ({summary['seconds']:.0f}s)")
    return 0 if passed or (args.allow_cpu and all(p["ok"] for p in check.parts.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
