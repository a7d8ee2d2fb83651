"""What a run leaves behind and reports: checkpoints (atomic, resumable) and metrics (metrics.jsonl,
TensorBoard, Prometheus gauges, the curve).

Imports nothing of the runtime above it; `rljob.api` only."""
