"""Process hygiene every role process shares: dying with its launcher, termination messages, prefixed child
output, rate-limited logs and retries with back-off.

Imports nothing of rljob: it is the bottom of the runtime."""
