"""The gym task family: gymnasium environments served over the network, batched policy inference in the
rollouts, PPO in the actor.

May import every runtime room below it (`process/`, `records/`, `wire/`, `sandbox/`, `weights/`, `optim/`),
`rljob.algorithms` and `rljob.api`; never `llm/`."""
