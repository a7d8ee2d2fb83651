"""Where an llm job's prompts come from: dataset rows (files, hub datasets, the builtin arithmetic set), prompt
rendering with the chat template, the prompt stream and benchmark formats.

May import `rljob.api` and the runtime rooms below the task families (the sandbox for benchmark code tests)."""
