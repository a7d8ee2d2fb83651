"""`rljob`: validate, render and run RLJob manifests; print the CRD.

Exit codes: 0 success, 1 invalid input or failed job, 2 wrong usage.
"""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import yaml

from rljob import __version__
from rljob.api import InvalidRLJob, RLJob, load_job_file
from rljob.api.crd import crd_yaml
from rljob.api.loading import iter_job_files
from rljob.api.view import shown
from rljob.cli import role as role_cli
from rljob.cli import run as run_cli
from rljob.cli.advice import print_advisories, print_cluster_notes, print_tracker_notes
from rljob.cli.operator import operator
from rljob.cli.run import SetOption
from rljob.launch.overrides import overrides_edit
from rljob.launch.upstream import resolve_local_upstream
from rljob.operator.manifests import build_children
from rljob.operator.manifests.checks import build_problems
from rljob.operator.settings import OperatorSettings, SettingsError
from rljob.runtime.preflight import preflight

app = typer.Typer(
    name="rljob",
    help="Kubernetes-native RL post-training: one RLJob manifest, run locally or on a cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's job.yaml) as readable `|` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


class RenderPart(StrEnum):
    all = "all"
    job = "job"
    children = "children"


ManifestArg = Annotated[Path, typer.Argument(help="RLJob manifest (YAML).", dir_okay=False)]


def _print_problems(exc: InvalidRLJob, overrides: list[str] | None) -> None:
    for problem in exc.problems:
        typer.secho(problem.render(exc.source), fg=typer.colors.RED, err=True)
    if overrides:
        typer.secho(f"(after --set {' --set '.join(overrides)})", fg=typer.colors.RED, err=True)


def _summary(job: RLJob) -> str:
    roles = job.spec.roles
    pods = ", ".join(f"{r} x{roles.get(r).replicas}" for r in ("actor", "rollout", "env", "reward"))
    return f"RLJob {job.name} ({job.spec.task.type}, {job.spec.algorithm.name}; {pods})"


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="RLJob manifests (YAML); several documents per file are fine.")],
    load: Annotated[
        bool,
        typer.Option(
            "--load",
            help="Also read the dataset, find the model, load the reward functions and text environment and build "
            "one gym environment, as `rljob run` does before it starts (relative paths from the working directory).",
        ),
    ] = False,
    set_: SetOption = None,
) -> None:
    """Check manifests as the operator and `rljob run` do: every problem is printed with its field path and how to
    fix it."""
    failed = False
    try:
        settings = OperatorSettings.from_env()
    except SettingsError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    for path, result in iter_job_files(files, overrides_edit(set_ or [])):
        if isinstance(result, InvalidRLJob):
            failed = True
            _print_problems(result, set_)
        else:
            for job in result:
                # The preflight every launcher runs, and what only the pod builders can see (reserved ports,
                # names, mounts), as the operator will; with --load, what `rljob run` reads and loads too.
                problems = build_problems(job)
                if load and not problems:
                    try:  # what `rljob run` with its default --out would load
                        problems = preflight(resolve_local_upstream(job, Path("runs").resolve()), load=True)
                    except InvalidRLJob as exc:
                        problems = exc.problems
                if problems:
                    failed = True
                    for problem in problems:
                        typer.secho(problem.render(str(path)), fg=typer.colors.RED, err=True)
                    continue
                typer.echo(f"ok {path}: {_summary(job)}")
                if not load:
                    print_tracker_notes(job, str(path))
                print_advisories(job, str(path), departures=True)
                print_cluster_notes(job, str(path), settings)
    if failed:
        raise typer.Exit(1)


@app.command()
def render(
    file: ManifestArg,
    only: Annotated[
        RenderPart,
        typer.Option(help="`job`: only the resolved RLJob; `children`: only what the operator creates."),
    ] = RenderPart.all,
    set_: SetOption = None,
) -> None:
    """Print the resolved job (every default filled in), then every manifest the operator would create.

    Images and pod defaults come from the same RLJOB_OPERATOR_* variables the operator reads.
    """
    try:
        job = load_job_file(file, overrides_edit(set_ or []))
        children = [] if only is RenderPart.job else build_children(job, OperatorSettings.from_env())
    except InvalidRLJob as exc:
        _print_problems(exc, set_)
        raise typer.Exit(1) from None
    except SettingsError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    print_advisories(job, str(file))
    if only is not RenderPart.job:
        print_cluster_notes(job, str(file), OperatorSettings.from_env())
    documents = [] if only is RenderPart.children else [shown(job)]
    typer.echo(yaml.dump_all(documents + children, Dumper=_BlockDumper, sort_keys=False, width=100), nl=False)


@app.command()
def crd() -> None:
    """Print the RLJob CustomResourceDefinition (generated from the API models)."""
    typer.echo(crd_yaml(), nl=False)


@app.command()
def version() -> None:
    """Print the rljob version."""
    typer.echo(f"rljob {__version__}")


app.command()(operator)
role_cli.register(app)
run_cli.register(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
