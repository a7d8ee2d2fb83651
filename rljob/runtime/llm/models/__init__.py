"""The policy as a model: loading it from a directory, the hub or the builtin tiny config (with a tokenizer
trained on the job's rows), its dtype, exporting it for an engine, and the KV-cache helpers both the engines
and the learner use.

May import `rljob.api` and the runtime rooms below the task families."""
