"""The gym actor and rollout programs, given the policy the job names: a builtin network (mlp, cnn), or a
vision-language-action policy (`model.vla`, `rljob.runtime.vla`). The gym loops take the builder as an argument, so
`gym/` never imports the llm family a VLA is built on."""

from __future__ import annotations

from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.runtime.gym.actor import run_actor
from rljob.runtime.gym.models import build_builtin_policy
from rljob.runtime.gym.rollout import run_rollout
from rljob.runtime.wire.context import RoleContext


def build_gym_policy(spec: RLJobSpec, observation_space: Any, action_space: Any) -> Any:
    if spec.model.vla is None:
        return build_builtin_policy(spec, observation_space, action_space)
    from rljob.runtime.vla.policy import build_vla_actor_critic

    return build_vla_actor_critic(spec, observation_space, action_space)


def run_gym_actor(context: RoleContext) -> int:
    return run_actor(context, build_gym_policy)


def run_gym_rollout(context: RoleContext) -> int:
    return run_rollout(context, build_gym_policy)
