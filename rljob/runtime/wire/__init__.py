"""How a role process knows who it is and reaches its peers: its identity (the `RLJOB_*` contract every launcher
fills, pod ports and names), the role context (the resolved job, logging, the stop event), the ZeroMQ transport
for control and data messages, the role HTTP endpoint (health, metrics, progress) and the actor's ranks.

May import `rljob.api`, `process/` and `records/`."""
