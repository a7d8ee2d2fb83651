"""In-pod runtime: what runs inside each role process, whichever launcher started it.

Rooms, bottom to top; a room imports only from rooms below it (and from `rljob.api` and `rljob.algorithms`),
never from a room beside it or above it (tests/test_layers.py keeps this true):

1. `process/` (signals, parent death, termination messages, log limits, retries) and `records/` (checkpoints and
   metrics): know nothing of roles or jobs' loops.
2. `wire/`: how a role knows who it is and reaches its peers: identity and the `RLJOB_*` contract, the role
   context, the ZeroMQ transport, the role HTTP endpoint, actor ranks.
3. `sandbox/` (confined user and model code), `weights/` (actor -> rollout weight movement: broadcast, files,
   CUDA IPC) and `optim/` (optimizers, learning-rate schedules, the divergence guard).
4. `gym/` and `llm/`: the two task families' loops, siblings that never import each other.
5. `roles/` (the program each (task, role) runs, the reward and text-env roles, a collocated rollout beside
   its actor) and `preflight` (what every launcher, `rljob validate` and the operator check before anything
   starts).
"""
