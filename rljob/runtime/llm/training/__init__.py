"""The actor's update: the learner (micro-batches, the policy loss, shared prompt prefixes), sharding (DDP,
FSDP2, gathering weights for sync), log-probs and entropy in chunks, batches and packing, and the supervised
warm-up.

May import every llm folder below it (`data/`, `models/`, `replicas/`, `engines/`, `episodes/`), the runtime
rooms below the task families, `rljob.algorithms` and `rljob.api`."""
