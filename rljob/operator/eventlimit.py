"""A per-RLJob rate limit for the Kubernetes Events the operator posts.

Events are for people reading `kubectl describe rljob`; a job flapping between states must not turn into a
stream of API writes (every Event is a write to etcd). Like client-go's spam filter, each job has a token
bucket: `burst` Events at once, then one more every `refill_seconds`. What the limit holds back is counted
(`rljob_operator_events_suppressed`) and still logged; status conditions carry the same information.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EventBucket:
    burst: int = 25
    refill_seconds: float = 10.0
    tokens: float = -1.0
    """Tokens left (-1: not used yet, starts full)."""
    updated: float = 0.0

    def allow(self, now: float) -> bool:
        """Whether an Event may be posted at `now` (monotonic seconds); takes a token when it may."""
        if self.tokens < 0:
            self.tokens, self.updated = float(self.burst), now
        elapsed = max(now - self.updated, 0.0)
        self.tokens = min(float(self.burst), self.tokens + elapsed / self.refill_seconds)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
