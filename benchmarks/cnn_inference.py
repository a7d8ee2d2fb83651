"""How the gym rollout should run the builtin cnn: the torch module (`TorchPolicy`) or numpy, as it runs the mlp.

The mlp's rollout policy is numpy (`NumpyPolicy`): for small MLPs torch's per-call overhead costs more than the
arithmetic. For convolutions the arithmetic dominates. This times one `act` (8 observations, one thread, as the
rollout calls it each environment step) for two networks: the MiniGrid example's small cnn on [28, 28, 3] views and
the Nature DQN cnn on stacked Atari frames [4, 84, 84]; torch against a numpy forward pass of the same weights
(convolutions as sliding windows and `tensordot`, checked to agree with torch).

Usage: python benchmarks/cnn_inference.py [--calls 50]
Writes benchmarks/results/cnn_inference.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "cnn_inference.json"
BATCH = 8


def numpy_forward(model: Any) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The cnn's policy outputs and values computed with numpy from a snapshot of its weights (ReLU dense layers, as
    the examples use)."""
    import torch

    convs = [
        (m.weight.detach().numpy(), m.bias.detach().numpy(), m.stride[0])
        for m in model.trunk
        if isinstance(m, torch.nn.Conv2d)
    ]
    dense = [
        (m.weight.detach().numpy().T.copy(), m.bias.detach().numpy())
        for m in model.trunk
        if isinstance(m, torch.nn.Linear)
    ]
    heads = [
        (m.weight.detach().numpy().T.copy(), m.bias.detach().numpy()) for m in (model.policy_head, model.value_head)
    ]
    layout = model.layout

    def forward(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = obs.transpose(0, *(a + 1 for a in layout.permutation)).reshape(len(obs), layout.channels, layout.height, -1)
        x = x.astype(np.float32) * np.float32(layout.scale)
        for weight, bias, stride in convs:
            k = weight.shape[-1]
            windows = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
            x = np.tensordot(windows, weight, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)
            x = np.maximum(x + bias[None, :, None, None], 0)
        x = x.reshape(len(x), -1)
        for weight, bias in dense:
            x = np.maximum(x @ weight + bias, 0)
        return x @ heads[0][0] + heads[0][1], (x @ heads[1][0] + heads[1][1])[:, 0]

    return forward


def time_per_call(call: Callable[[], Any], calls: int) -> float:
    call()  # warm up
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def measure(calls: int) -> dict[str, Any]:
    import gymnasium
    import torch

    from rljob.api.spec import BuiltinNetwork
    from rljob.runtime.gym.models import build_actor_critic
    from rljob.runtime.gym.torch_policy import TorchPolicy

    torch.set_num_threads(1)
    cases = {
        "minigrid-pixels-ppo cnn on [28, 28, 3]": (
            (28, 28, 3),
            BuiltinNetwork(
                architecture="cnn",
                channels=[16, 32],
                kernel_sizes=[4, 3],
                strides=[2, 2],
                hidden_sizes=[64],
                activation="relu",
            ),
        ),
        "Nature DQN cnn on [4, 84, 84]": (
            (4, 84, 84),
            BuiltinNetwork(architecture="cnn", hidden_sizes=[512], activation="relu"),
        ),
    }
    results = {}
    for name, (shape, network) in cases.items():
        torch.manual_seed(0)
        model = build_actor_critic(
            network, gymnasium.spaces.Box(0, 255, shape, dtype=np.uint8), gymnasium.spaces.Discrete(6)
        )
        obs = np.random.default_rng(0).integers(0, 256, (BATCH, *shape), dtype=np.uint8)
        policy, forward = TorchPolicy(model, seed=0), numpy_forward(model)
        with torch.no_grad():
            expected = model.policy_and_value(torch.from_numpy(obs))[0].numpy()
        np.testing.assert_allclose(forward(obs)[0], expected, rtol=1e-4, atol=1e-5)
        torch_s = time_per_call(lambda p=policy, o=obs: p.act(o), calls)
        numpy_s = time_per_call(lambda f=forward, o=obs: f(o), calls)
        results[name] = {
            "torch_ms_per_act": round(torch_s * 1000, 2),
            "numpy_ms_per_forward": round(numpy_s * 1000, 2),
            "numpy_over_torch": round(numpy_s / torch_s, 1),
        }
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    return {
        "observations_per_call": BATCH,
        "threads": 1,
        "calls": calls,
        "cases": results,
        "measured": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    RESULTS.write_text(json.dumps(measure(args.calls), indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
