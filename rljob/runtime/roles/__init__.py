"""The program each (task type, role) runs, and the roles that are thin wrappers of their family's parts: the
reward role, the text-env role and a collocated rollout supervised beside its actor.

The top of the runtime beside `preflight`: may import everything below it, never `preflight`. The loops of
gym and llm jobs live side by side in `rljob.runtime.gym` and `rljob.runtime.llm`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rljob.runtime.wire.context import RoleContext

RoleMain = Callable[[RoleContext], int]

ROLE_PROGRAMS: dict[tuple[str, str], str] = {
    ("gym", "actor"): "rljob.runtime.roles.gym_policy:run_gym_actor",
    ("gym", "rollout"): "rljob.runtime.roles.gym_policy:run_gym_rollout",
    ("gym", "env"): "rljob.runtime.gym.env:run_env",
    ("llm", "actor"): "rljob.runtime.llm.actor:run_actor",
    ("llm", "rollout"): "rljob.runtime.llm.rollout:run_rollout",
    ("llm", "env"): "rljob.runtime.roles.textenv:run_text_env",
    ("llm", "reward"): "rljob.runtime.roles.reward:run_reward",
}
"""`module:function` per (task.type, role); a pair missing here is a role that task type has no use for."""


class RoleNotUsed(LookupError):
    """This task type runs no such role (a gym job has no reward role, an llm job without a text env no env role)."""


def role_program(task_type: str, role: str) -> RoleMain:
    try:
        target = ROLE_PROGRAMS[(task_type, role)]
    except KeyError:
        used = sorted(r for t, r in ROLE_PROGRAMS if t == task_type)
        raise RoleNotUsed(
            f"task.type {task_type} jobs run the roles {', '.join(used)}; set spec.roles.{role}.replicas to 0"
        ) from None
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)
