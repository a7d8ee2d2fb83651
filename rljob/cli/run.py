"""`rljob run FILE`: run a job locally, every role replica as a process, with a live progress bar."""

from __future__ import annotations

import contextlib
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

RUN_HELP = (
    "Run an RLJob locally (every role replica as a process on this machine) or, with --ray, on a Ray cluster "
    "(every role replica as a Ray actor)."
)


def _load(file: Path, overrides: list[str]):
    from rljob.api import InvalidRLJob, validate_job
    from rljob.api.loading import parse_documents
    from rljob.cli.advice import print_advisories
    from rljob.launch.overrides import OverrideError, apply_overrides

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        typer.secho(f"cannot read {file}: {exc.strerror}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    try:
        documents = parse_documents(text, str(file))
        if len(documents) != 1:
            typer.secho(
                f"{file}: `rljob run` takes one RLJob per file, found {len(documents)} documents",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(1)
        data = apply_overrides(documents[0].data, overrides)
        # Line numbers only help when the file is what gets validated.
        node = documents[0].node if not overrides else None
        job = validate_job(data, source=str(file), node=node)
    except OverrideError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except InvalidRLJob as exc:
        for problem in exc.problems:
            typer.secho(problem.render(exc.source), fg=typer.colors.RED, err=True)
        if overrides:
            typer.secho(f"(after --set {' --set '.join(overrides)})", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    print_advisories(job, str(file))
    return job


def last_episodes_mean(metrics_path: Path, episodes: int = 20) -> float | None:
    """Mean return of the last `episodes` finished episodes recorded in metrics.jsonl."""
    if not metrics_path.exists():
        return None
    from rljob.runtime.records.metrics import read_metrics

    returns: list[float] = []
    for record in read_metrics(metrics_path):
        returns.extend(record.get("episode_returns") or [])
    tail = returns[-episodes:]
    return sum(tail) / len(tail) if tail else None


def accuracy_summary(metrics_path: Path, window: int = 10) -> list[str] | None:
    """llm jobs: mean accuracy of the first and last `window` steps, and the first and last held-out accuracy, a
    line each (each fits in 80 columns)."""
    if not metrics_path.exists():
        return None
    from rljob.runtime.records.metrics import read_metrics

    records = read_metrics(metrics_path)
    values = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    if not values:
        return None
    first, last = values[:window], values[-window:]
    before, after = sum(first) / len(first), sum(last) / len(last)
    lines = [f"accuracy: {before:.3f} (first {len(first)} steps) -> {after:.3f} (last {len(last)})"]
    held_out = [r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None]
    if held_out:
        lines.append(f"held-out accuracy: {held_out[0]:.3f} -> {held_out[-1]:.3f}")
    return lines


SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a field by YAML key path, e.g. --set spec.trainer.steps=20 (repeatable); the value is read "
        "as YAML, as the manifest is.",
    ),
]
"""`--set`, the same for `run`, `validate` and `render`: what a user runs is what they checked."""


def tensorboard_command(logdir: Path) -> str:
    """`tensorboard --logdir ...` with the executable this rljob was installed beside (the venv's), so the line
    works as printed without activating the venv first."""
    beside = Path(sys.executable).parent / "tensorboard"
    program = str(beside) if beside.exists() else "tensorboard"
    return f"{program} --logdir {logdir}"


def print_results(result, run_dir: Path) -> None:
    """What the run gave, on stdout (progress and role logs go to stderr): `rljob run job.yaml > run.log` keeps
    exactly the results."""
    from rich.console import Console
    from rich.markup import escape

    out = Console(soft_wrap=True)
    metrics_path = run_dir / "metrics.jsonl"
    reached = last_episodes_mean(metrics_path)
    if result.exit_code == 0:
        out.print(f"[bold green]done[/]: {escape(result.reason)}")
    elif result.exit_code == 130:
        out.print(f"[bold yellow]stopped[/]: {escape(result.reason)}")
    else:
        out.print(f"[bold red]failed[/]: {escape(result.reason)}")
    if reached is not None:
        out.print(f"mean return over the last 20 episodes: [bold]{reached:.1f}[/]")
    for line in accuracy_summary(metrics_path) or []:
        out.print(line)
    model_dir = run_dir / "model"
    if model_dir.exists():
        out.print(f"model:   {escape(str(model_dir))} (Hugging Face format)")
    if result.actor_restarts or result.replica_restarts:
        replicas = ", ".join(f"{name} {count}" for name, count in sorted(result.replica_restarts.items())) or "none"
        out.print(f"restarts: actor group {result.actor_restarts}; replicas: {escape(replicas)}")
    if result.preemptions:
        out.print(f"preemptions: actor group {result.preemptions} (resumed from its checkpoint, not counted)")
    out.print(f"metrics: {escape(str(metrics_path))}")
    curve = run_dir / "curve.png"
    if curve.exists():
        out.print(f"curve:   {escape(str(curve))}")
    out.print(f"tensorboard: {escape(tensorboard_command(run_dir / 'tb'))}")
    out.print(f"logs:    {escape(str(run_dir / 'logs'))}")


def _resolve_upstream(job, runs_root: Path, file: Path):
    """Models named by another RLJob (`source: job`) come from that job's newest finished run beside this one."""
    from rljob.api import InvalidRLJob
    from rljob.launch.upstream import resolve_local_upstream

    try:
        return resolve_local_upstream(job, runs_root)
    except InvalidRLJob as exc:
        for problem in exc.problems:
            typer.secho(problem.render(str(file)), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def run(
    file: Annotated[Path, typer.Argument(help="RLJob manifest (YAML).", dir_okay=False)],
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default runs/<job>-<timestamp>).")] = None,
    set_: SetOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="Do not echo role logs (they are still in OUT/logs).")] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run on an existing Ray cluster: `auto` (RAY_ADDRESS, else the cluster `ray start` began on this "
            "machine), host:6379 or ray://host:10001; `local` starts a throwaway cluster on this machine.",
        ),
    ] = None,
    placement_timeout: Annotated[
        float,
        typer.Option(
            "--placement-timeout",
            metavar="SECONDS",
            help="With --ray: how long a job that fits the cluster waits for its resources to be free.",
        ),
    ] = 120.0,
) -> None:
    """Run an RLJob locally or on a Ray cluster (--ray)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from rljob.launch.health import HealthWatch
    from rljob.launch.local import LaunchError, LocalRun, read_progress
    from rljob.launch.stall import STALLED, StallWatch
    from rljob.launch.supervisor import GiveUp
    from rljob.runtime.records.metrics import read_metrics

    job = _load(file, set_ or [])
    run_dir = out or Path("runs") / f"{job.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    job = _resolve_upstream(job, run_dir.resolve().parent, file)
    console = Console(stderr=True)
    colours = {"actor": "cyan", "rollout": "magenta", "env": "green", "reward": "yellow", "launcher": "bold red"}

    def sink(name: str, line: str) -> None:
        if quiet and name != "launcher":
            return
        colour = colours.get(name.split("-")[0], "white")
        console.print(f"[{colour}]{escape(name):>10}[/] | {escape(line)}", highlight=False, soft_wrap=True)

    try:
        local = (
            LocalRun(job, run_dir.resolve(), sink)
            if ray_address is None
            else _ray_run(job, run_dir.resolve(), sink, ray_address, placement_timeout)
        )
    except LaunchError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    total = job.spec.trainer.steps
    # No job name (the line above the bar says it) and a bar that takes what is left: one line at 80 columns.
    progress = Progress(
        BarColumn(bar_width=None),
        MofNCompleteColumn(),
        TextColumn("{task.fields[score]}"),
        TextColumn("{task.fields[rate]} steps/s"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(compact=True),
        console=console,
        transient=False,
        expand=True,
    )
    score_name = "return" if job.spec.task.type == "gym" else "reward"
    task = progress.add_task(job.name, total=total, score=f"{score_name} -", rate="-")
    state = {"last": 0.0, "first_step": None, "first_time": 0.0}

    policy = job.spec.failure_policy
    stall = StallWatch(policy.progress_deadline_seconds)
    health = HealthWatch(job.spec.health, llm=job.spec.task.type == "llm")

    def say_health(verdicts) -> None:
        for verdict in verdicts:  # one line per transition, never per step
            what = verdict.type if verdict.active else f"{verdict.type} {verdict.reason.lower()}"
            console.print(f"[{'bold yellow' if verdict.active else 'green'}]{what}[/]: {escape(verdict.message)}")

    def tick() -> None:
        now = time.monotonic()
        if now - state["last"] < 0.5:
            return
        state["last"] = now
        report = read_progress(local.progress_url, timeout=0.3)
        said = stall.observe(int(report["step"]) if report else None, total, (report or {}).get("issue", ""))
        if said is not None:
            kind, message = said
            colour = "bold yellow" if kind == STALLED else "green"
            console.print(f"[{colour}]{kind.lower()}[/]: {escape(message)}")
            if kind == STALLED and policy.on_stalled == "FailJob":
                raise GiveUp(f"stalled: {message} (spec.failurePolicy.onStalled: FailJob)")
        say_health(health.observe(report))
        if not report:
            return
        step = int(report["step"])
        if state["first_step"] is None or step < state["first_step"]:
            state["first_step"], state["first_time"] = step, now
        elapsed = now - state["first_time"]
        rate = (step - state["first_step"]) / elapsed if elapsed > 0 else 0.0
        reward = report.get("rewardMean")
        score = (
            f"{score_name} {reward:.{1 if score_name == 'return' else 3}f}" if reward is not None else f"{score_name} -"
        )
        if report.get("accuracy") is not None:
            score += f" acc {report['accuracy']:.3f}"
        progress.update(task, completed=step, score=score, rate=f"{rate:.1f}")

    where = "" if ray_address is None else f" on Ray ({ray_address})"
    console.print(f"[bold]rljob run[/] {escape(str(file))} -> {escape(str(run_dir))}{escape(where)}")
    try:
        with progress:
            try:
                local.start()
            except LaunchError as exc:
                local.stop()
                typer.secho(str(exc), fg=typer.colors.RED, err=True)
                raise typer.Exit(1) from None
            except BaseException:
                local.stop()  # Ctrl-C (or a failed spawn) while starting: take down what did start
                raise
            result = local.supervise(on_tick=tick)
            with contextlib.suppress(GiveUp):  # the run is over: a last look at its progress only
                tick()
            if (run_dir / "metrics.jsonl").exists():  # the steps trained after that look
                say_health(health.settle(read_metrics(run_dir / "metrics.jsonl")))
    finally:
        disconnect = getattr(local, "disconnect", None)
        if disconnect is not None:
            disconnect()
    if result.exit_code == 0:
        progress.update(task, completed=total)
    print_results(result, run_dir)
    raise typer.Exit(result.exit_code)


def _ray_run(job, run_dir: Path, sink, address: str, placement_timeout: float):
    """The Ray launcher, or a clear error when the `ray` extra is not installed."""
    from rljob.launch.local import LaunchError

    try:
        from rljob.launch.ray_cluster import RayRun
    except ImportError as exc:
        raise LaunchError(
            f"--ray {address}: Ray is not installed here ({exc}); install it with `pip install 'rljob[ray]'`"
        ) from None
    if job.spec.roles.rollout.autoscale is not None:
        # The Ray launcher places a fixed set of replicas; say so rather than ignore the field silently.
        sink(
            "launcher",
            "spec.roles.rollout.autoscale is applied by `rljob run` without --ray and by the operator; on Ray the "
            f"job runs its {job.spec.roles.rollout.replicas} rollout replica(s) throughout",
        )
    return RayRun(job, run_dir, sink, address=address, placement_timeout_s=placement_timeout)


def register(app: typer.Typer) -> None:
    app.command(help=RUN_HELP)(run)
