"""Generation engines behind one interface (`base`: `GenerationEngine`, `Sampling`, `Completion`, weight
updates): `hf` (transformers `generate`) and `vllm` (a vLLM engine, its worker extension in `vllm_worker`).
A new engine goes here, implementing `base.GenerationEngine`; `rljob.runtime.llm.rollout_engine` starts the
one a job names.

May import `llm/data/`, `llm/models/`, the runtime rooms below the task families and `rljob.api`."""
