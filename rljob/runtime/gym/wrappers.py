"""`spec.task.gym.wrappers`: gymnasium wrappers applied around each environment, by name or by class reference.

Builtin names map to a function `(env, args) -> env`; a `module` reference is a `gymnasium.Wrapper` subclass called
as `Class(env, **args)`. Every problem is a `WrapperConfigError` naming the list entry, raised when the env role
starts, before any step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gymnasium

from rljob.api.spec import GymWrapper
from rljob.runtime.sandbox.user_code import load_user_module

FIELD = "spec.task.gym.wrappers"


class WrapperConfigError(ValueError):
    """A wrapper entry cannot be applied as written; the message names the entry and the fix."""


def _normalize_observation(env: gymnasium.Env, args: Mapping[str, Any]) -> gymnasium.Env:
    return gymnasium.wrappers.NormalizeObservation(env, **args)


def _normalize_reward(env: gymnasium.Env, args: Mapping[str, Any]) -> gymnasium.Env:
    return gymnasium.wrappers.NormalizeReward(env, **args)


def _frame_stack(env: gymnasium.Env, args: Mapping[str, Any]) -> gymnasium.Env:
    options = dict(args)
    size = options.pop("size", 4)
    return gymnasium.wrappers.FrameStackObservation(env, stack_size=size, **options)


def _atari(env: gymnasium.Env, args: Mapping[str, Any]) -> gymnasium.Env:
    # The ALE's own frame skipping would compound AtariPreprocessing's: v5 ids skip 4 frames unless told not to.
    skip = getattr(env.unwrapped, "_frameskip", 1)
    if skip != 1:
        raise WrapperConfigError(
            f"{FIELD}: atari skips frames itself (frame_skip, default 4) but {env.spec.id if env.spec else 'the env'} "
            f"already skips {skip}: set spec.task.gym.envKwargs.frameskip: 1 (or use a NoFrameskip-v4 id)"
        )
    options = {"noop_max": 30, "frame_skip": 4, "screen_size": 84, "terminal_on_life_loss": False, **args}
    return gymnasium.wrappers.AtariPreprocessing(env, **options)


def _minigrid_rgb(env: gymnasium.Env, args: Mapping[str, Any]) -> gymnasium.Env:
    try:
        from minigrid.wrappers import ImgObsWrapper, RGBImgObsWrapper, RGBImgPartialObsWrapper
    except ImportError:
        raise WrapperConfigError(
            f"{FIELD}: minigrid-rgb needs the minigrid package (pip install 'rljob[pixels]')"
        ) from None
    options = dict(args)
    partial = bool(options.pop("partial", True))
    tile_size = int(options.pop("tile_size", 8))
    if options:
        raise WrapperConfigError(
            f"{FIELD}: minigrid-rgb takes args tile_size and partial, not {', '.join(sorted(options))}"
        )
    view = RGBImgPartialObsWrapper if partial else RGBImgObsWrapper
    return ImgObsWrapper(view(env, tile_size=tile_size))


BUILTIN_WRAPPERS: dict[str, Callable[[gymnasium.Env, Mapping[str, Any]], gymnasium.Env]] = {
    "normalize-observation": _normalize_observation,
    "normalize-reward": _normalize_reward,
    "frame-stack": _frame_stack,
    "atari": _atari,
    "minigrid-rgb": _minigrid_rgb,
}


def _wrapper_class(ref: str, field: str, base_dir: Path | None) -> type:
    module, location, name = load_user_module(
        ref, base_dir, lambda message: WrapperConfigError(f"{field}: {message}"), "wrappers.py", "env"
    )
    found = getattr(module, name, None)
    if not isinstance(found, type) or not issubclass(found, gymnasium.Wrapper):
        what = "nothing" if found is None else type(found).__name__
        raise WrapperConfigError(
            f"{field}: {location}:{name} is {what}, not a gymnasium.Wrapper subclass; name a class defined as "
            "`class MyWrapper(gymnasium.Wrapper)`"
        )
    return found


def apply_wrappers(env: gymnasium.Env, wrappers: list[GymWrapper], base_dir: Path | None = None) -> gymnasium.Env:
    """`env` inside each configured wrapper, the first innermost."""
    for index, spec in enumerate(wrappers):
        field = f"{FIELD}[{index}]"
        label = spec.builtin or spec.module or ""
        if spec.builtin is not None:
            builtin = BUILTIN_WRAPPERS[spec.builtin]  # the schema's names are this table's keys (a test checks)

            def call(inner: gymnasium.Env, build=builtin, args=spec.args) -> gymnasium.Env:
                return build(inner, args)
        else:
            cls = _wrapper_class(spec.module or "", f"{field}.module", base_dir)
            try:
                inspect.signature(cls).bind(env, **spec.args)
            except TypeError as exc:
                raise WrapperConfigError(f"{field}.args: {label} cannot be built with these args: {exc}") from None
            except ValueError:  # no signature to check: find out by calling it
                pass

            def call(inner: gymnasium.Env, cls=cls, args=spec.args) -> gymnasium.Env:
                return cls(inner, **args)

        try:
            env = call(env)
        except WrapperConfigError:
            raise
        except Exception as exc:
            raise WrapperConfigError(
                f"{field}: wrapping {env.spec.id if env.spec else 'the environment'} in {label} failed: "
                f"{type(exc).__name__}: {exc}. Fix {field}.args or the order of the wrappers."
            ) from None
    return env
