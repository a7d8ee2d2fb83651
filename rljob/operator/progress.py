"""RL progress pulled from actor replica 0's `GET /progress` (the operator pulls; roles never call the API).

Pull, not push: role pods need no ServiceAccount token and no RBAC, and a job's progress is one small
GET per reconcile interval. The URL comes from the pod's IP and `spec.logging.prometheusPort`;
`ProgressReader(url_for=...)` takes another function (tests point it at a local server).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import aiohttp
from pydantic import ValidationError

from rljob.api.status import Progress

logger = logging.getLogger(__name__)

PROGRESS_KEYS = (
    "step",
    "totalSteps",
    "rewardMean",
    "accuracy",
    "updatedAt",
    "issue",
    "trainerWait",
    "rolloutIdle",
    "entropy",
    "mismatchKl",
)

ProgressUrl = Callable[[dict[str, Any], int], "str | None"]


def pod_progress_url(pod: dict[str, Any], port: int) -> str | None:
    """`http://<pod IP>:<port>/progress`; None until the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/progress"


def parse_progress(data: dict[str, Any]) -> Progress:
    """The contract's keys (accuracy only from llm jobs); anything else is not status material. A value that
    is not a finite number where a number belongs (NaN, Infinity: Python's json reads them) is left out: JSON
    has no such numbers and the API server refuses a status that holds one (400), which would stop every
    status write of the job."""
    known = {k: data[k] for k in PROGRESS_KEYS if k in data and _finite(data[k])}
    progress = Progress.model_validate(known, by_alias=True)
    # A string such as "NaN" passes the model's lax float parsing: drop what it turned into.
    dropped = {name: None for name, value in progress if not _finite(value)}
    return progress.model_copy(update=dropped) if dropped else progress


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


class ProgressReader:
    """Reads progress over one shared HTTP session; a failed read is logged and yields None."""

    def __init__(self, url_for: ProgressUrl = pod_progress_url, timeout: float = 2.0) -> None:
        self.url_for = url_for
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def read(self, pod: dict[str, Any], port: int) -> Progress | None:
        url = self.url_for(pod, port)
        if url is None:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    logger.debug("progress %s answered %s", url, response.status)
                    return None
                data = await response.json(content_type=None)
            if not isinstance(data, dict):
                return None
            return parse_progress(data)
        except (aiohttp.ClientError, TimeoutError, ValueError, ValidationError) as exc:
            logger.debug("progress %s unreadable: %s", url, exc)
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
