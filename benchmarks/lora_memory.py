"""The llm actor's training state with and without LoRA (`model.lora`), on the same builtin model.

Counted, not sampled: the parameters, the parameters that train, their gradients and Adam's state (two fp32
tensors per trained parameter, read from the optimizer after one real GRPO step of `LLMLearner`), in bytes. On
models this small a process's RSS is dominated by torch and transformers themselves, so an RSS difference would
say nothing; these byte counts are what scales with the model. Activations are not counted: LoRA keeps them about
the same (the base layers still run forward and backward).

Also counted: the bytes one weight sync sends the rollouts: the whole state dict without LoRA; with it, the merged
weights (`model.lora.sync: merged`, the default) or the adapters alone (`sync: adapters`, vLLM rollouts).

Usage: python benchmarks/lora_memory.py [--hidden 128,512 --layers 2,8 --rank 8]
Writes benchmarks/results/lora_memory.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "lora_memory.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def footprint(hidden: int, layers: int, lora: Any) -> dict[str, int]:
    import torch

    from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, ModelSpec, TrainerSpec
    from rljob.runtime.llm.models.lora import adapter_file_state, add_lora, merged_state_dict
    from rljob.runtime.llm.models.policy import build_char_tokenizer, build_tiny_qwen2
    from rljob.runtime.llm.training.learner import LLMLearner

    tokenizer = build_char_tokenizer(["0123456789+=-*/ abcdefgh"])
    spec = ModelSpec(builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=hidden, num_layers=layers))
    model = build_tiny_qwen2(spec, tokenizer, max_length=64, seed=0)
    if lora is not None:
        add_lora(model, lora)
    learner = LLMLearner(
        model,
        AlgorithmSpec(name="grpo", kl_coef=0.0),
        TrainerSpec(steps=1, optimizer="adam"),
        pad_id=tokenizer.pad_token_id,
        temperature=1.0,
        max_response_tokens=4,
    )
    g = torch.Generator().manual_seed(0)
    samples = [
        {
            "prompt_ids": [tokenizer.bos_token_id, 5, 6, 7],
            "response_ids": torch.randint(4, len(tokenizer), (4,), generator=g).tolist(),
            "rollout_logprobs": [-3.0] * 4,
            "advantage": float(torch.randn(1, generator=g)),
            "reward": 0.0,
            "version": 0,
        }
        for _ in range(8)
    ]
    learner.update(samples)
    trained = [p for p in model.parameters() if p.requires_grad]

    def nbytes(state: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())

    if lora is None:
        sync = {"sync_bytes": nbytes(model.state_dict())}
    else:
        sync = {
            "sync_bytes_merged": nbytes(merged_state_dict(model)),
            "sync_bytes_adapters": nbytes(adapter_file_state(model)),
        }
    return {
        **sync,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trained),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in trained),
        "optimizer_state_bytes": sum(
            t.numel() * t.element_size()
            for state in learner.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ),
    }


def main() -> None:
    from rljob.api.spec import LoraSpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", default="128,512")
    parser.add_argument("--layers", default="2,8")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    lora = LoraSpec(rank=args.rank, alpha=2.0 * args.rank, target_modules=TARGETS)
    rows = []
    for hidden, layers in zip(map(int, args.hidden.split(",")), map(int, args.layers.split(",")), strict=True):
        full, adapted = footprint(hidden, layers, None), footprint(hidden, layers, lora)
        training_state = {
            k: v["gradient_bytes"] + v["optimizer_state_bytes"] for k, v in (("full", full), ("lora", adapted))
        }
        rows.append(
            {
                "model": f"tiny-qwen2 hidden {hidden}, {layers} layers",
                "full": full,
                "lora": adapted,
                "gradient_and_optimizer_bytes_ratio": training_state["lora"] / training_state["full"],
            }
        )
        print(
            f"hidden {hidden} x {layers} layers: {full['trainable_parameters']} -> {adapted['trainable_parameters']} "
            f"trainable; gradients + Adam state {training_state['full']} -> {training_state['lora']} bytes; a sync "
            f"{full['sync_bytes']} bytes, merged {adapted['sync_bytes_merged']}, adapters "
            f"{adapted['sync_bytes_adapters']}",
            flush=True,
        )
    result = {
        "what": f"llm actor training state with and without model.lora (rank {args.rank} on {', '.join(TARGETS)}), "
        "counted in bytes after one GRPO step, and the bytes one weight sync sends (merged or adapters alone); RSS is "
        "not reported: on models this small it is torch's own",
        "machine": platform.platform(),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
