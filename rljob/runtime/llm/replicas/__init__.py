"""The actor's view of the other replicas of an llm job: which rollouts are members (autoscaling), which chunk
each was sent and what to re-send when one dies, and the reward replicas that score responses.

May import `rljob.api` and the runtime rooms below the task families (`wire/` for the transport, `weights/`)."""
