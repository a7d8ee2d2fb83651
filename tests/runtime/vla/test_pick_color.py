"""PickColor: one square, picked only when it is the target colour; success at the episode's one step."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from rljob.runtime.vla.pick_color import COLOURS

ENV_ID = "rljob.runtime.vla.pick_color:PickColor-v0"


def shown_colour(image: np.ndarray) -> str:
    lit = image.reshape(-1, 3)[image.reshape(-1, 3).any(axis=1)]
    return next(name for name, rgb in COLOURS.items() if (lit == rgb).all())


@pytest.mark.parametrize("target", ["red", "blue"])
def test_picking_exactly_the_target_colour_succeeds(target):
    env = gymnasium.make(ENV_ID, target=target)
    shown = []
    for seed in range(40):
        image, _ = env.reset(seed=seed)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        colour = shown_colour(image)
        shown.append(colour)
        _, reward, terminated, truncated, info = env.step(1 if colour == target else 0)
        assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
        env.reset(seed=seed)
        _, reward, _, _, info = env.step(0 if colour == target else 1)
        assert (reward, info["success"]) == (0.0, False)
    assert {"red", "blue"} == set(shown)


def test_the_continuous_variant_picks_on_a_positive_action():
    env = gymnasium.make(ENV_ID, continuous=True)
    assert env.action_space.shape == (1,)
    image, _ = env.reset(seed=3)
    pick = shown_colour(image) == "red"
    assert env.step(np.array([0.7 if pick else -0.7], dtype=np.float32))[3 + 1]["success"]


def test_an_unknown_target_colour_is_refused():
    with pytest.raises(ValueError, match="target must be one of red, blue"):
        gymnasium.make(ENV_ID, target="green")
