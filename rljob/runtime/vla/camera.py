"""`CameraImage`: a gymnasium wrapper that keeps one RGB camera image of a Dict observation, what a VLA reads.

Simulators give dictionaries (ManiSkill3: `sensor_data/<camera>/rgb`; gymnasium's `AddRenderObservation`:
`pixels`); the VLA reads one [height, width, 3] image. `key` is the path to it, `/` between levels. A torch tensor
is moved to numpy and a leading batch dimension of 1 (a simulator's single environment) dropped.
Use it as `task.gym.wrappers: [{module: "rljob.runtime.vla.camera:CameraImage", args: {key: ...}}]`.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class CameraImage(gymnasium.ObservationWrapper):
    def __init__(self, env: gymnasium.Env, key: str) -> None:
        super().__init__(env)
        self.path = [part for part in key.split("/") if part]
        space: Any = env.observation_space
        for depth, part in enumerate(self.path):
            if not isinstance(space, spaces.Dict) or part not in space.spaces:
                where = "/".join(self.path[:depth]) or "the observation"
                have = ", ".join(space.spaces) if isinstance(space, spaces.Dict) else str(space)
                raise ValueError(f"key {key!r}: {where} has no {part!r} (it has: {have})")
            space = space.spaces[part]
        shape = tuple(int(s) for s in space.shape)
        if len(shape) == 4 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) != 3 or shape[-1] != 3:
            raise ValueError(f"key {key!r} holds {space}, not one RGB image [height, width, 3]")
        self.observation_space = spaces.Box(0, 255, shape, dtype=np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        for part in self.path:
            observation = observation[part]
        if hasattr(observation, "cpu"):  # a simulator's torch tensor
            observation = observation.cpu().numpy()
        image = np.asarray(observation)
        return image.reshape(self.observation_space.shape).astype(np.uint8, copy=False)
