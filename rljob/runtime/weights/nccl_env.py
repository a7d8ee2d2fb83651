"""The NCCL settings both ends of a weight sync must agree on, set before any communicator exists.

Imports nothing but `os`: the role entry calls it first thing, before torch is imported (and before a collocated
rollout is started beside the actor, which inherits them).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

GROUP_TIMEOUT_S = 60
"""How long a weight-sync group's members wait for each other (forming it, and in each collective)."""

NCCL_CUMEM_ENV = "NCCL_CUMEM_ENABLE"
NCCL_CUMEM_DEFAULT = "0"
"""The value both ends of an NCCL weight sync run with unless the user set one. vLLM before 0.11 sets 0 in its
workers when the variable is unset (NCCL itself enables cuMem from 2.19), and a communicator whose members disagree
on it fails: the actor and every rollout start with the same value, the one older vLLM would choose; vLLM keeps a
value set explicitly (from 0.9.1)."""
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def align_nccl_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before any NCCL communicator of this process (and the processes it starts, vLLM's workers among them): the
    settings both ends of a weight sync must agree on, unless the user chose them. NCCL reads them once per process.

    `TORCH_NCCL_NONBLOCKING_TIMEOUT` bounds a non-blocking communicator's creation (`_nccl_group`); torch reads it
    once per process too."""
    environ.setdefault(NCCL_CUMEM_ENV, NCCL_CUMEM_DEFAULT)
    environ.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(GROUP_TIMEOUT_S))
