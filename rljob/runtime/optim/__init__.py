"""Optimizers and learning-rate schedules from the spec, and the guard that stops a run whose loss or gradient
norm is not finite (exit 65), for both task families.

May import `rljob.api`, `rljob.algorithms`, `process/`, `records/` and `wire/`."""
