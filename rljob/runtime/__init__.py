"""In-pod runtime: roles, driver loop, transport, weight sync, checkpoints, metrics."""
