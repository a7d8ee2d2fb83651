"""The llm task family (GRPO and its relatives): prompts in, sampled responses scored and trained on.

Inside, bottom to top; a folder imports only from folders below it:

1. `data/` (dataset rows, prompt rendering, benchmark formats), `models/` (loading and exporting the policy, KV
   caches) and `replicas/` (the actor's view of the rollout and reward replicas: membership, routing, retries);
2. `engines/`: the generation engine interface and its types (`base`), hf and vLLM behind it;
3. `episodes/`: single- and multi-turn episodes, text environments, reward functions;
4. `training/`: the learner, sharding (DDP, FSDP2), log-probs, batches and packing, the supervised warm-up;
5. the loops at this level: `actor` (actor rank 0 drives the step), `rollout`, `setup` (what every llm process
   builds first) and `rollout_engine` (the engine a job names, started with the job's policy).

May import every runtime room below the task families (`process/`, `records/`, `wire/`, `sandbox/`,
`weights/`, `optim/`), `rljob.algorithms` and `rljob.api`; never `gym/`.
"""
