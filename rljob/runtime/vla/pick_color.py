"""`PickColor-v0`: a tiny camera-image task for vision-language-action policies, nothing to install.

Each episode shows a 32 x 32 RGB image with one square, red or blue (colour, place at random); the policy picks it
up or leaves it, and should pick only squares of the `target` colour (the job's instruction says which: "pick the
red square"). Actions: Discrete(2), 0 leave and 1 pick; or, with `continuous=True`, a Box [-1, 1] whose sign says
(positive: pick), so the VLA's action bins are exercised. One decision per episode: reward 1 and
`info["success"]` True when the choice is right, else 0 and False. A random policy succeeds half the time.

Use it as `task.gym.envId: rljob.runtime.vla.pick_color:PickColor-v0` (gymnasium imports this module, which
registers the id).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

SIZE = 32
SQUARE = 8
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220)}


class PickColorEnv(gymnasium.Env[np.ndarray, Any]):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, target: str = "red", continuous: bool = False, render_mode: str | None = None) -> None:
        if target not in COLOURS:
            raise ValueError(f"target must be one of {', '.join(COLOURS)} (got {target!r})")
        self.target = target
        self.continuous = continuous
        self.render_mode = render_mode
        self.observation_space = spaces.Box(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)
        self.action_space: spaces.Space = (
            spaces.Box(-1.0, 1.0, (1,), dtype=np.float32) if continuous else spaces.Discrete(2)
        )
        self._image = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
        self._target_shown = False

    def _draw(self) -> np.ndarray:
        image = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
        colour = self.target if self._target_shown else next(c for c in COLOURS if c != self.target)
        top, left = (int(v) for v in self.np_random.integers(0, SIZE - SQUARE + 1, size=2))
        image[top : top + SQUARE, left : left + SQUARE] = COLOURS[colour]
        return image

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._target_shown = bool(self.np_random.integers(0, 2))
        self._image = self._draw()
        return self._image.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        pick = bool(np.asarray(action).reshape(-1)[0] > 0) if self.continuous else int(action) == 1
        success = pick == self._target_shown
        return self._image.copy(), float(success), True, False, {"success": success}

    def render(self) -> np.ndarray:
        return self._image.copy()


gymnasium.register(id="PickColor-v0", entry_point=PickColorEnv)
