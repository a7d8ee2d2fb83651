"""Warnings about valid jobs (see `rljob.api.rules.advisories`), printed the same way by every command, and notes on
what only a cluster can tell (`rljob validate`, `rljob render`)."""

from __future__ import annotations

import typer

from rljob.api import RLJob
from rljob.api.rules import advisories, departure_note
from rljob.operator.manifests.checks import operator_checkpoint_claim
from rljob.operator.manifests.storage import checkpoint_storage_class
from rljob.operator.settings import OperatorSettings
from rljob.runtime.records.trackers import tracker_problems


def print_advisories(job: RLJob, source: str | None, *, departures: bool = False) -> None:
    """Warnings every command prints; with `departures` (`rljob validate`), also the note on settings that depart
    from the algorithm's paper."""
    for problem in advisories(job):
        typer.secho(f"warning: {problem.render(source)}", fg=typer.colors.YELLOW, err=True)
    note = departure_note(job) if departures else None
    if note is not None:
        typer.secho(f"note: {note.render(source)}", fg=typer.colors.YELLOW, err=True)


def print_cluster_notes(job: RLJob, source: str | None, settings: OperatorSettings) -> None:
    """What only the cluster can tell, said as a note rather than checked: no cluster is consulted here."""
    claim = operator_checkpoint_claim(job)
    if claim is None or checkpoint_storage_class(job, settings):
        return
    where = f"{source}: " if source else ""
    typer.secho(
        f"note: {where}spec.checkpoint.storage.storageClassName is unset: on Kubernetes the operator makes the "
        f"PersistentVolumeClaim {claim} in the StorageClass the chart names (jobDefaults.checkpointStorage."
        "storageClassName), else in the cluster's default one; a cluster with neither leaves it unbound and the actor "
        "pods Pending (the job's CheckpointStorage condition then says NoDefaultStorageClass). Not checked here: "
        "`kubectl get storageclass` marks the default one '(default)'.",
        fg=typer.colors.YELLOW,
        err=True,
    )


def print_tracker_notes(job: RLJob, source: str | None) -> None:
    """The trackers the job lists whose libraries this machine lacks: an error for `rljob run` (and `validate
    --load`), only a note for a manifest bound for a cluster, whose actor image has them."""
    for problem in tracker_problems(job.spec):
        typer.secho(
            f"note: {problem.render(source)} (on this machine; `rljob run` and `rljob validate --load` refuse it here, "
            "the actor images have the trackers extra)",
            fg=typer.colors.YELLOW,
            err=True,
        )
