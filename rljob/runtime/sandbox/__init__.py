"""Running code rljob did not write: model-written programs (`code_exec`) and users' modules (`file.py:fn`
rewards, text environments), confined in child processes (namespaces, rlimits, an audit-hook fallback), and
the loading of `file.py:name` references.

May import `rljob.api`, `process/`, `records/` and `wire/`; docs/sandbox.md says what each platform enforces."""
