# ruff: noqa: UP017, B905
# This script runs under the GPU machine's own python, which may be older than rljob's 3.11: it must get as far as
# saying so (no datetime.UTC, no zip(strict=...), no str.removesuffix before the python check).
"""One command that verifies the GPU path on a machine with an NVIDIA GPU: `make gpu-check`.

Made for a GPU machine that has python3 with a CUDA build of torch and transformers preinstalled but no package
registry: the project's other dependencies come along as wheels (`make gpu-wheels`, run beforehand on a machine
with registry access, writes them to build/gpu-wheels), which this script unpacks into build/gpu-site and puts on
PYTHONPATH together with the repository. Then, each bounded in time (under 10 minutes in all):

1. what the check needs, before anything runs: the python (>= 3.11, and the one the wheels were downloaded for),
   the architecture (the wheels' platform: `make gpu-wheels GPU_ARCH=aarch64` for a GH200), torch (>= 2.6: the
   update's `torch.nn.utils.get_total_norm`) and transformers (one that honours a static cache's
   `max_cache_len`), CUDA and the device; then every module a part imports is imported once with the wheels on
   the path, and the wheels' own requirements are checked against what the machine has. Anything missing stops
   the check here, in one line naming what to install or which wheel to add (check.json lists every problem);
2. the `cuda`-marked tests (tests/gpu: the actor's update on CUDA against the CPU's, bf16, a CUDA actor's weight
   broadcast; the weight sync between CUDA tensors on one GPU, which goes by gloo: NCCL refuses two ranks on one
   GPU, so its NCCL rounds need a second GPU and skip here, saying so), each test under its own time limit
   (CUDA_TEST_TIMEOUT_S, well under the part's) and each result in check.json as it comes, so a part cut short
   keeps the results of the tests that ran;
3. `examples/cartpole-ppo.yaml` with the actor on the GPU (gpusPerReplica 1): the return it reaches;
4. `examples/grpo-tiny-arithmetic.yaml` with the actor on the GPU (the hf rollout on the CPU: one GPU cannot hold
   two replicas' ranks): its accuracy, held-out accuracy and step time;
5. the same example collocated (`roles.rollout.collocated`, `weightSync.method: ipc`): actor and hf rollout share
   the one GPU, weights pass by CUDA IPC handles and the rollout sleeps (weights to the CPU) while the actor
   trains: its accuracy, its largest rollout/trainer log-prob gap (the weights arrived whole) and step time;
6. `benchmarks/grpo_vs_trl.py --device cuda` (100 steps, seed 0): rljob collocated against TRL's GRPOTrainer on
   the same GPU, same model, prompts and settings: completions/s of each, their ratio, seconds to 50% training
   accuracy, the update's share of the GPU's fp32 matmul roof (its JSON and plot under OUT/grpo_vs_trl/).

Everything lands in OUT/check.json (figures and pass/fail per part, rewritten after every part) and OUT/check.log
(every line printed, and every line of a part's output as it comes).
The exit code is 0 only when every part passed on a CUDA device. `--allow-cpu` runs the same parts without a GPU
(CUDA tests skip, roles on the CPU): how the wheel set is checked on a CPU machine before a GPU one is at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOTAL_LIMIT_S = 570.0
"""The whole check's budget: a part gets its own limit or what is left of this, whichever is less."""
COLLOCATED = ["spec.roles.rollout.collocated=true", "spec.rollout.weightSync.method=ipc"]

ROLE_MODULES = (
    "torch",
    "numpy",
    "pydantic",
    "yaml",
    "typer",
    "rich",
    "prometheus_client",
    "psutil",
    "zmq",
    "msgspec",
    "tensorboard",
    "matplotlib",
)
"""What every rljob role process imports (rljob.cli, rljob.runtime; the run's metrics: tensorboard, its curve)."""
NEEDS: dict[str, tuple[str, ...]] = {
    "cuda_tests": (*ROLE_MODULES, "pytest", "pytest_timeout", "gymnasium", "transformers"),
    "cartpole": (*ROLE_MODULES, "gymnasium"),
    "grpo_tiny": (*ROLE_MODULES, "transformers", "safetensors"),
    "grpo_tiny_collocated": (*ROLE_MODULES, "transformers", "safetensors"),
    "grpo_vs_trl": (*ROLE_MODULES, "transformers", "safetensors", "matplotlib", "datasets", "trl"),
}
"""The modules each part imports, in the order of the parts."""
MACHINE_ONLY = frozenset(
    {"torch", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub", "pyarrow", "accelerate"}
)
"""Distributions the GPU machine's python must have itself: CUDA builds, or what its torch and transformers were
installed with (a wheel of ours first on PYTHONPATH would replace theirs), so never brought as wheels."""
SHOWN = 3
"""A blocked part's reason names this many problems; the preflight part lists them all."""
WHEEL_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "prometheus_client": "prometheus-client", "_pytest": "pytest"}
MIN_PYTHON = (3, 11)
"""pyproject.toml's requires-python."""
MIN_TORCH = (2, 6)
"""`torch.nn.utils.get_total_norm`, which the updates use (pyproject.toml's floor)."""
CUDA_TEST_TIMEOUT_S = 90
"""Each `cuda`-marked test's own limit (pytest-timeout), well under the part's: a hung test fails alone."""
"""Distribution names where they differ from the module's."""

PREFLIGHT = """
import importlib, json, re, sys
from importlib import metadata
site, modules = sys.argv[1], sys.argv[2:]
imports = {}
for module in modules:
    try:
        importlib.import_module(module)
        imports[module] = None
    except Exception as exc:  # a wheel for another python or a machine package too old fails in many ways
        first = (str(exc).splitlines() or [""])[0]
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        imports[module] = {"error": f"{type(exc).__name__}: {first}"[:300], "missing": missing}
try:
    from packaging.requirements import Requirement
except ImportError:  # transformers needs packaging: without it the import check above has already failed
    Requirement = None
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels = {}
for dist in metadata.distributions(path=[site]) if site and Requirement else []:
    requires = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)  # the first on sys.path: ours where we bring it
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and req.specifier.contains(have, prereleases=True)
        requires.append({"name": canon(req.name), "spec": f"{req.name}{req.specifier}", "have": have, "ok": ok})
    wheels[canon(dist.metadata["Name"])] = {"version": dist.version, "requires": requires}
print(json.dumps({"imports": imports, "wheels": wheels}))
"""

PROBE = """
import json
found = {}
try:
    import torch
    cuda = torch.cuda.is_available()
    found.update({
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "get_total_norm": hasattr(torch.nn.utils, "get_total_norm"),
        "cuda": cuda, "devices": torch.cuda.device_count() if cuda else 0,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
    })
except Exception as exc:
    found["torch_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
try:
    import transformers
    from transformers import GenerationConfig
    found["transformers"] = transformers.__version__
    found["max_cache_len"] = hasattr(GenerationConfig(), "max_cache_len")  # older ones drop it silently
except Exception as exc:
    found["transformers_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
print(json.dumps(found))
"""


def version_tuple(text: str) -> tuple[int, ...]:
    """(2, 5, 1) for "2.5.1+cu121": the leading numbers of a version."""
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def wheel_targets(names: list[str]) -> tuple[set[tuple[int, int]], set[str]]:
    """The pythons (exact, from cpXY tags that are not abi3) and architectures the wheels named `names` were built
    for; pure-python wheels say nothing."""
    pythons: set[tuple[int, int]] = set()
    arches: set[str] = set()
    for name in names:
        fields = (name[: -len(".whl")] if name.endswith(".whl") else name).split("-")
        if len(fields) < 5:
            continue
        python, abi, platforms = fields[-3], fields[-2], fields[-1]
        tag = re.fullmatch(r"cp(\d)(\d+)", python)
        if tag and abi != "abi3":
            pythons.add((int(tag.group(1)), int(tag.group(2))))
        for platform_tag in platforms.split("."):
            arch = next(
                (a for a in ("x86_64", "aarch64", "arm64", "ppc64le", "s390x") if platform_tag.endswith(a)), None
            )
            if arch:
                arches.add(arch)
    return pythons, arches


def host_problems(python: tuple[int, int], machine: str, wheel_names: list[str]) -> list[str]:
    """What this python and machine lack for the check, before any child runs: one line each, naming the fix."""
    problems = []
    shown = ".".join(map(str, python))
    if python < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        problems.append(f"python {shown}: rljob needs python >= {need}: install python{need}+ (with a CUDA torch)")
    pythons, arches = wheel_targets(wheel_names)
    if pythons and python not in pythons:
        built = ", ".join(".".join(map(str, p)) for p in sorted(pythons))
        problems.append(
            f"build/gpu-wheels holds wheels for python {built}, this is python {shown}: "
            f"run make gpu-wheels GPU_PYTHON={shown} and copy build/gpu-wheels here again"
        )
    machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(machine.lower(), machine.lower())
    if arches and machine not in arches:
        problems.append(
            f"build/gpu-wheels holds {', '.join(sorted(arches))} wheels, this machine is {machine}: "
            f"run make gpu-wheels GPU_ARCH={machine} and copy build/gpu-wheels here again"
        )
    return problems


def stack_problems(probe: dict[str, Any]) -> list[str]:
    """What the machine's own torch and transformers (the PROBE's findings) lack: one line each, naming the fix."""
    problems = []
    need = ".".join(map(str, MIN_TORCH))
    if "torch" not in probe:
        problems.append(
            f"torch: {probe.get('torch_error', 'not importable')}: the GPU machine's python must have a CUDA torch "
            f">= {need} itself"
        )
    elif version_tuple(probe["torch"]) < MIN_TORCH or not probe.get("get_total_norm", True):
        problems.append(
            f"torch {probe['torch']}: rljob needs torch >= {need} (torch.nn.utils.get_total_norm): "
            f"install a CUDA torch >= {need}"
        )
    if "transformers" not in probe:
        problems.append(
            f"transformers: {probe.get('transformers_error', 'not importable')}: the GPU machine's python must have "
            "transformers itself"
        )
    elif not probe.get("max_cache_len", True):
        problems.append(
            f"transformers {probe['transformers']} ignores GenerationConfig.max_cache_len (the hf engine's static "
            "cache would be made and compiled again for every call length): install a newer transformers"
        )
    return problems


def one_line(problems: list[str]) -> str:
    """The line the check stops with: the first SHOWN problems, and how many more check.json holds."""
    more = f"; and {len(problems) - SHOWN} more (check.json: parts.requirements)" if len(problems) > SHOWN else ""
    return "gpu-check cannot run here: " + "; ".join(problems[:SHOWN]) + more


def last_json(output: str) -> dict[str, Any] | None:
    """The last line of `output` that is a JSON object (warnings may come before or after it), or None."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


TEST_RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def pytest_outcomes(output: str) -> dict[str, str]:
    """Each test's outcome from pytest's `-v` lines (also from the part of the output a killed run left)."""
    results: dict[str, str] = {}
    for line in output.splitlines():
        found = TEST_RESULT.match(line.strip())
        if found:
            results[found.group(1)] = found.group(2).lower()
    return results


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


def dist_of(module: str) -> str:
    """The distribution (wheel) name that provides a top-level module."""
    return WHEEL_OF.get(module, module.replace("_", "-"))


def import_reason(module: str, problem: dict[str, Any]) -> str:
    """One line for a module that did not import: what is missing and where it must come from."""
    missing = problem.get("missing")
    if missing and "." not in missing:
        dist = dist_of(missing)
        if dist in MACHINE_ONLY:
            return f"{module}: no module {missing}: the GPU machine's python must have {dist} itself"
        return f"{module}: no module {missing}: add {dist} to constraints/gpu-wheels.txt and rerun make gpu-wheels"
    # A submodule missing from a present package is a broken install, e.g. a compiled wheel for another python.
    return f"{module}: {problem['error']} (a wheel for another python than GPU_PYTHON, or a machine package too old?)"


def unmet_reason(dist: str, version: str, requirement: dict[str, Any]) -> str:
    """One line for a requirement of a wheel we bring that the machine (with our wheels) does not meet."""
    have = f"found {requirement['have']}" if requirement["have"] else "not found"
    if requirement["name"] in MACHINE_ONLY and not requirement["have"]:
        fix = "the GPU machine's python must have it itself"
    elif requirement["name"] in MACHINE_ONLY:
        fix = f"the machine's own: upgrade it there, or pin an older {dist} in constraints/gpu-wheels.txt"
    elif requirement["have"]:
        fix = f"pin a matching {requirement['name']} in constraints/gpu-wheels.txt"
    else:
        fix = f"add {requirement['name']} to constraints/gpu-wheels.txt"
    return f"{dist} {version} needs {requirement['spec']}, {have} ({fix})"


def preflight_verdicts(
    imports: dict[str, dict[str, Any] | None], wheels: dict[str, dict[str, Any]]
) -> dict[str, str | None]:
    """Per part: None when it can run, else why not in one line.

    `imports` maps each module to None (imported) or its problem ({"error", "missing"}); `wheels` maps each
    distribution we bring to its version and requirements ({"name", "spec", "have", "ok"}). A part is blocked by
    its own modules' import problems and by the unmet requirements of every wheel it reaches from them.
    """
    verdicts: dict[str, str | None] = {}
    for part, modules in NEEDS.items():
        reasons = [import_reason(m, imports[m]) for m in modules if imports.get(m)]
        todo, seen = [dist_of(m) for m in modules], set()
        while todo:  # the wheels this part's modules reach through the wheels' own requirements
            dist = todo.pop()
            if dist in seen or dist not in wheels:
                continue
            seen.add(dist)
            for requirement in wheels[dist]["requires"]:
                todo.append(requirement["name"])
                if not requirement["ok"]:
                    reasons.append(unmet_reason(dist, wheels[dist]["version"], requirement))
        reasons = list(dict.fromkeys(reasons))
        more = f"; and {len(reasons) - SHOWN} more (check.json: parts.requirements)" if len(reasons) > SHOWN else ""
        verdicts[part] = "; ".join(reasons[:SHOWN]) + more if reasons else None
    return verdicts


class Check:
    """Runs the parts, each in a child process with a time limit, and keeps every line and figure."""

    def __init__(self, out: Path, env: dict[str, str], budget_s: float = TOTAL_LIMIT_S) -> None:
        self.out = out
        self.env = env
        self.deadline = time.monotonic() + budget_s
        self.log = (out / "check.log").open("w")
        self.parts: dict[str, dict[str, Any]] = {}
        self.blocked: dict[str, str | None] = {}

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, part: str, command: list[str], limit_s: float) -> tuple[bool, str, float]:
        """Run `command` from the repository root; (exit 0 within the limit, its output, seconds). Every line of its
        output goes to check.log as it comes: a part killed at its limit keeps what it printed."""
        started = time.monotonic()
        limit_s = max(1.0, min(limit_s, self.deadline - started))  # every part within the whole check's budget
        shown = ["<script>" if before == "-c" else arg for before, arg in zip(["", *command], command)]
        self.say(f"== {part}: {' '.join(shown)}")
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: a kill at the limit takes its children too
        )
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(limit_s, kill)
        timer.start()
        lines: list[str] = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            self.log.write(f"  {line.rstrip()}\n")
            self.log.flush()
        process.wait()
        timer.cancel()
        seconds = time.monotonic() - started
        ok = process.returncode == 0 and not killed.is_set()
        verdict = f"over its {limit_s:.0f}s limit" if killed.is_set() else f"exit {process.returncode}"
        self.say(f"== {part}: {verdict} in {seconds:.1f}s")
        return ok, "".join(lines), seconds

    def record(self, part: str, ok: bool, seconds: float, **figures: Any) -> None:
        self.parts[part] = {"ok": ok, "seconds": round(seconds, 1), **figures}
        self.save()

    def save(self, **summary: Any) -> None:
        """check.json as it stands: rewritten after every part, so a check cut short keeps what it found."""
        (self.out / "check.json").write_text(json.dumps({**summary, "parts": self.parts}, indent=1) + "\n")

    def runs(self, part: str) -> bool:
        """Whether `part` passed the preflight; if not, it is recorded as failed with the reason and not run."""
        reason = self.blocked.get(part)
        if reason:
            self.say(f"== {part}: not run: {reason}")
            self.record(part, False, 0.0, not_run=reason)
        return not reason


def requirements(check: Check, site: Path | None, wheel_names: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The first part: everything the check needs, before anything else runs; (every problem, one line each, naming
    what to install or which wheel to add; what the machine is). This python and architecture against the wheels,
    the machine's torch and transformers (a child, PROBE), every part's modules and the wheels' own requirements
    (a child, PREFLIGHT)."""
    started = time.monotonic()
    problems = host_problems(sys.version_info[:2], platform.machine(), wheel_names)
    ok, output, _ = check.run("requirements", [sys.executable, "-c", PROBE], 120)
    machine = last_json(output) or {}
    if not machine:
        problems.append(f"the machine probe failed (exit status {'0' if ok else 'not 0'}): see check.log")
    problems += stack_problems(machine) if machine else []
    machine.update(python=platform.python_version(), arch=platform.machine(), host=platform.node(), cpus=os.cpu_count())
    modules = list(dict.fromkeys(m for needs in NEEDS.values() for m in needs))
    ok, output, _ = check.run("requirements", [sys.executable, "-c", PREFLIGHT, str(site or ""), *modules], 180)
    found = last_json(output) if ok else None
    imports: dict[str, str] = {}
    unmet: list[str] = []
    if found is None:
        problems.append("the import check failed: see check.log")
    else:
        check.blocked = preflight_verdicts(found["imports"], found["wheels"])
        imports = {m: import_reason(m, p) for m, p in found["imports"].items() if p}
        unmet = [
            unmet_reason(dist, wheel["version"], r)
            for dist, wheel in found["wheels"].items()
            for r in wheel["requires"]
            if not r["ok"]
        ]
        # torch and transformers' own import problems are named once, by the probe's lines above.
        problems += [reason for m, reason in imports.items() if m not in ("torch", "transformers") or not machine]
        problems += unmet
    problems = list(dict.fromkeys(problems))
    check.record(
        "requirements",
        not problems,
        time.monotonic() - started,
        problems=problems,
        imports=imports,
        unmet=unmet,
        **machine,
    )
    return problems, machine


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
    check.say(
        f"rljob gpu-check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {len(wheels)} wheels"
    )

    problems, machine = requirements(check, args.site if wheels else None, wheels)
    on_gpu = bool(machine.get("cuda"))
    if problems:  # nothing else runs: each part would fail on it, later and less clearly
        check.say(one_line(problems))
        check.save(date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}", passed=False)
        return 1
    if not on_gpu and not args.allow_cpu:
        check.say("no CUDA device here: run `make gpu-check` on an NVIDIA GPU machine (--allow-cpu: parts on CPU)")
    if on_gpu or args.allow_cpu:
        if check.runs("cuda_tests"):
            junit = args.out / "cuda-tests.xml"
            tests = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "cuda", "-v", "-p", "no:cacheprovider"]
            tests += [f"--timeout={CUDA_TEST_TIMEOUT_S}", f"--junitxml={junit}"]
            ok, output, seconds = check.run("cuda_tests", tests, 240)
            results = pytest_outcomes(output)  # from the lines as they came: also those of a run cut short
            suite = ET.parse(junit).getroot().find("testsuite") if junit.exists() and ok else None
            keys = ("tests", "failures", "errors", "skipped")
            counts = {k: int(suite.get(k, 0)) for k in keys} if suite is not None else {}
            check.record("cuda_tests", ok and bool(counts), seconds, **counts, results=results)

        gpus = 1 if on_gpu else 0
        if check.runs("cartpole"):
            records = rljob_run(check, "cartpole", "cartpole-ppo.yaml", gpus, 200, [])
            check.parts["cartpole"].update(return_last10=mean_of(records[-10:], "return_mean"))

        if check.runs("grpo_tiny"):
            records = rljob_run(check, "grpo_tiny", "grpo-tiny-arithmetic.yaml", gpus, 240, [])
            evals = [r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None]
            check.parts["grpo_tiny"].update(
                accuracy_first10=mean_of(records[:10], "accuracy"),
                accuracy_last10=mean_of(records[-10:], "accuracy"),
                eval_accuracy_last=evals[-1] if evals else None,
                step_s_median={k: median_of(records, f"time_{k}_s") for k in ("generate", "reward", "train", "sync")},
            )

        if check.runs("grpo_tiny_collocated"):
            records = rljob_run(check, "grpo_tiny_collocated", "grpo-tiny-arithmetic.yaml", gpus, 240, COLLOCATED)
            check.parts["grpo_tiny_collocated"].update(
                accuracy_first10=mean_of(records[:10], "accuracy"),
                accuracy_last10=mean_of(records[-10:], "accuracy"),
                mismatch_max_gap_max=max((r["mismatch_max_gap"] for r in records), default=None),
                step_s_median={k: median_of(records, f"time_{k}_s") for k in ("generate", "reward", "train", "sync")},
            )

        if check.runs("grpo_vs_trl"):
            grpo_vs_trl(check, on_gpu)

    every_part = {"requirements", *NEEDS}
    all_passed = set(check.parts) == every_part and all(part["ok"] for part in check.parts.values())
    passed = on_gpu and all_passed
    summary = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
        "passed": passed,
        "on_gpu": on_gpu,
        "seconds": round(time.monotonic() - started, 1),
        "wheels": wheels,
    }
    check.save(**summary)
    verdict = "PASSED" if passed else "every part passed, on the CPU (not a GPU pass)" if all_passed else "NOT PASSED"
    check.say(f"{verdict}: {args.out / 'check.json'} ({summary['seconds']:.0f}s)")
    return 0 if passed or (args.allow_cpu and all_passed) else 1


if __name__ == "__main__":
    sys.exit(main())
