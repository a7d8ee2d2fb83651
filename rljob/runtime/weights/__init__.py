"""Where a weight update travels from the actor to the rollouts: a torch.distributed broadcast in buckets
(`sync`, NCCL between GPUs and gloo otherwise), safetensors files on a shared volume (`sync`), and CUDA IPC
handles or shared memory for a rollout collocated with its actor (`ipc`).

May import `rljob.api`, `process/`, `records/` and `wire/`."""
