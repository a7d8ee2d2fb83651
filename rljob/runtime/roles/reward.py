"""The reward role: scores llm responses with `spec.reward.functions` over the transport.

Methods: `status` -> {"tag"}; `score` {"samples": [RewardInput, ...]} -> {"rewards": float32 [n],
"terms": {name: [float]}, "errors": {name: int}, "unparsed": {judge name: int}, "tag"}. The server answers one
request at a time; the scorer runs the functions of a batch on `sandbox.maxConcurrency` threads. A user function
that cannot be loaded is a FatalConfigError (exit 78); one that fails on a sample scores 0 and is counted. Reward
models (`functions[i].model`) and generative judges (`functions[i].judge`) run on this replica's GPU when the role
has `gpusPerReplica`, else on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rljob.runtime.llm.episodes.rewards import RewardConfigError, RewardScorer
from rljob.runtime.wire.context import FatalConfigError, RoleContext
from rljob.runtime.wire.ranks import rank_device
from rljob.runtime.wire.transport import Payload, RequestServer, process_tag


def run_reward(context: RoleContext) -> int:
    spec = context.job.spec
    if spec.task.llm is None:
        context.log.error("the reward role scores llm responses; this job's task.type is %s", spec.task.type)
        return 1
    try:
        # Relative `file.py` references resolve against the working directory the role was started in.
        scorer = RewardScorer(
            spec.reward,
            answer_key=spec.task.llm.dataset.answer_key,
            prompt_key=spec.task.llm.dataset.prompt_key,
            base_dir=Path.cwd(),
            device=rank_device(spec.roles.reward.gpus_per_replica, 0, "spec.roles.reward.gpusPerReplica"),
        )
    except RewardConfigError as exc:
        raise FatalConfigError(str(exc)) from None
    identity = context.identity
    tag = process_tag()
    samples_scored = 0
    errors_total = 0
    warned: set[str] = set()

    def status(_: Payload) -> Payload:
        return {"tag": tag, "functions": scorer.names}

    def score(request: Payload) -> Payload:
        nonlocal samples_scored, errors_total
        scored = scorer.score(request["samples"], beat=context.heartbeat.beat)
        samples_scored += len(scored.rewards)
        errors_total += sum(scored.errors.values())
        for name, message in scored.error_messages.items():
            if name not in warned:  # the first failure tells what is wrong; after that the error metric counts
                warned.add(name)
                context.log.warning("reward function %s failed (scored 0, counted in its errors): %s", name, message)
        return {
            "rewards": np.asarray(scored.rewards, dtype=np.float32),
            "terms": scored.terms,
            "errors": scored.errors,
            "unparsed": scored.unparsed,
            "tag": tag,
        }

    from rljob.runtime.wire.health import RoleHealth

    health = RoleHealth(
        context,
        counters={"reward_samples_total": lambda: samples_scored, "reward_errors_total": lambda: errors_total},
    )
    server = RequestServer(identity.endpoints["reward"][identity.replica], {"status": status, "score": score})
    health.ready()
    context.log.info("scoring with %s", ", ".join(scorer.names) or "no functions (every reward is 0)")
    try:
        server.serve(context.stop.is_set, beat=context.heartbeat.beat)
    finally:
        server.close()
        scorer.close()
        health.close()
    return 0
