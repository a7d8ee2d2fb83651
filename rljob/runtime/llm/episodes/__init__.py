"""What turns generations into scored episodes: multi-turn episodes against text environments, the builtin and
user text environments (`TextEnv`), and reward functions (rules, users' modules, sandboxed code execution).

May import `llm/engines/` (its types), `llm/data/`, `llm/models/`, the runtime rooms below the task families
and `rljob.api`."""
