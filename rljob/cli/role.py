"""`rljob role <actor|rollout|env|reward>`: the entrypoint of every role process (local or in a pod)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from rljob.api import InvalidRLJob

if TYPE_CHECKING:
    from rljob.runtime.wire.identity import RoleIdentity

ROLES = ("actor", "rollout", "env", "reward")


def role(
    name: Annotated[str, typer.Argument(help="actor, rollout, env or reward", metavar="ROLE")],
) -> None:
    """Run one role process. Identity and peers come from RLJOB_* variables (set by `rljob run` or the operator)."""
    from rljob.runtime.process.parent_death import die_with_launcher

    die_with_launcher()  # first: a local launcher SIGKILLed from here on still takes this process with it
    from rljob.runtime.process.early_stop import hold_stop_requests

    hold_stop_requests()  # a stop asked for while this process starts is acted on once its program can
    from rljob.runtime.weights.nccl_env import align_nccl_environment

    # Before any NCCL communicator here or in what this process starts (ranks, a collocated rollout, vLLM's workers).
    align_nccl_environment()
    if name not in ROLES:
        typer.secho(f"unknown role {name!r}: choose one of {', '.join(ROLES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    from rljob.runtime.wire.identity import (
        COLLOCATED_ROLLOUT_HEALTH_ENV,
        EXIT_FATAL_CONFIG,
        IdentityError,
        RoleIdentity,
    )

    try:
        identity = RoleIdentity.from_env()
    except IdentityError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    if identity.role != name:
        typer.secho(f"RLJOB_ROLE is {identity.role!r} but this is `rljob role {name}`", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    collocated = None
    if identity.collocated_rollout_metrics_port:
        # A collocated job's actor pod: this process runs the rollout replica beside the actor, whatever it trains.
        from rljob.runtime.roles.collocated import collocated_rollout

        try:
            collocated = collocated_rollout(identity).start()
        except InvalidRLJob as exc:
            for problem in exc.problems:
                typer.secho(problem.render(exc.source), fg=typer.colors.RED, err=True)
            raise typer.Exit(EXIT_FATAL_CONFIG) from None
        # For the actor's program and its ranks (which inherit this environment): ready only with the rollout.
        os.environ[COLLOCATED_ROLLOUT_HEALTH_ENV] = collocated.health_url
    try:
        code = _run_role(identity, name)
    finally:
        if collocated is not None:
            collocated.stop()
    if collocated is not None:
        from rljob.runtime.roles.collocated import pod_exit_code

        code = pod_exit_code(code, collocated.gave_up)
    if identity.starts_ranks:
        raise typer.Exit(code)
    exit_without_teardown(code)


def _run_role(identity: RoleIdentity, name: str) -> int:
    """The role's program in this process (or, for a replica with several ranks, its ranks); its exit code."""
    if identity.starts_ranks:
        # An actor replica with several ranks (one per GPU): this process starts them and answers for them.
        from rljob.runtime.wire.ranks import run_rank_group

        return run_rank_group(identity)
    from rljob.runtime.wire.context import FatalConfigError, start_role
    from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG

    try:
        context = start_role(identity)
    except InvalidRLJob as exc:
        for problem in exc.problems:
            typer.secho(problem.render(exc.source), fg=typer.colors.RED, err=True)
        return EXIT_FATAL_CONFIG
    from rljob.runtime.roles import RoleNotUsed, role_program

    try:
        run = role_program(context.job.spec.task.type, name)
    except RoleNotUsed as exc:
        context.log.error("%s", exc)
        return EXIT_FATAL_CONFIG
    sys.stdout.flush()
    try:
        return run(context)
    except FatalConfigError as exc:
        # No restart can fix it: say what to change, and exit with the code the launcher does not restart.
        context.log.error("%s", exc)
        return EXIT_FATAL_CONFIG


def exit_without_teardown(code: int) -> NoReturn:
    """End a role process whose program has returned, skipping the interpreter's teardown.

    The program has closed what it wrote (metrics, checkpoints, TensorBoard files, sockets) and its threads
    are done or daemons; what the interpreter would still do is unload thousands of modules (torch, and the
    torch._dynamo that any optimizer step imports): about 1 CPU-second, 3.6 s on a loaded 2-core machine,
    that every run waited for at its end (the launcher waits for each role process to exit). Log handlers
    and standard streams are flushed first. Only for the role process itself (never call it in-process).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(app: typer.Typer) -> None:
    app.command()(role)
