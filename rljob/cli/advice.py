"""Warnings about valid jobs (see `rljob.api.rules.advisories`), printed the same way by every command."""

from __future__ import annotations

import typer

from rljob.api import RLJob
from rljob.api.rules import advisories


def print_advisories(job: RLJob, source: str | None) -> None:
    for problem in advisories(job):
        typer.secho(f"warning: {problem.render(source)}", fg=typer.colors.YELLOW, err=True)
