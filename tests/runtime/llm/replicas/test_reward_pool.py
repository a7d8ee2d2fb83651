"""Reward replicas past their deadline: named, their work moved to the others, taken back when they answer.

Real server processes on the real transport, frozen with SIGSTOP as a hung peer is (a stuck native call, a
frozen container): the pool must not wait on them while another replica can score."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from rljob.runtime.llm.replicas.pool import RewardPool
from rljob.runtime.wire.deadlines import LatencyDeadline, LateReplicas
from rljob.runtime.wire.transport import RequestClient

SCORER = textwrap.dedent(
    """
    import sys
    from rljob.runtime.wire.transport import RequestServer
    replica = int(sys.argv[2])
    def score(payload):
        samples = payload["samples"]
        rewards = [float(s["response"] == s["row"]["answer"]) for s in samples]
        return {"rewards": rewards, "terms": {"scored_by": [float(replica)] * len(samples)}, "errors": {"x": 1},
                "unparsed": {"judge": len(samples) // 2}}
    RequestServer(sys.argv[1], {"status": lambda _: {"tag": "t"}, "score": score}).serve(lambda: False)
    """
)
DEADLINE_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def scorers():
    processes: list[subprocess.Popen[bytes]] = []

    def start(count: int) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
        endpoints = [f"127.0.0.1:{free_port()}" for _ in range(count)]
        for i, endpoint in enumerate(endpoints):
            processes.append(subprocess.Popen([sys.executable, "-c", SCORER, endpoint, str(i)]))
        for endpoint in endpoints:  # up and answering before the 1 s deadlines start counting
            client = RequestClient(endpoint, timeout=60, retries=0)
            client.call("status")
            client.close()
        return endpoints, processes

    yield start
    for process in processes:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def samples(n: int) -> tuple[list[dict], np.ndarray]:
    """Every third response is right: a reward in the wrong place would show."""
    right = np.array([float(i % 3 == 0) for i in range(n)])
    return [{"response": "7" if r else "5", "row": {"answer": "7"}} for r in right], right


def make_pool(endpoints: list[str]) -> tuple[RewardPool, LateReplicas]:
    late = LateReplicas(logging.getLogger("test.pool"))
    return RewardPool(endpoints, LatencyDeadline("reward", override=DEADLINE_S), late), late


def test_a_frozen_replica_is_named_its_work_moves_and_it_rejoins_when_it_answers(scorers, caplog):
    caplog.set_level(logging.INFO, logger="test.pool")
    endpoints, processes = scorers(2)
    pool, late = make_pool(endpoints)
    batch, right = samples(12)
    rewards, terms, errors, unparsed = pool.score(batch)  # both up: the batch is split over both
    assert rewards.tolist() == right.tolist() and set(terms["scored_by"]) == {0.0, 1.0} and errors == {"x": 2}
    assert unparsed == {"judge": 6}  # each part's count, summed: a judge's share of outputs without a score

    processes[1].send_signal(signal.SIGSTOP)
    rewards, terms, errors, _ = pool.score(batch)  # its half waits out one deadline, then goes to reward-0
    assert rewards.tolist() == right.tolist() and terms["scored_by"] == [0.0] * 12
    assert errors == {"x": 2}  # each sample scored once into the batch: reward-1's part once, by reward-0
    named = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
    assert len(named) == 1 and re.fullmatch(r"reward-1 has not answered for \d+ s; its work goes to reward-0", named[0])
    assert [name for name, _ in late.snapshot()] == ["reward-1"]
    assert late.issue().startswith("reward-1 has not answered for")

    rewards, terms, _, _ = pool.score(batch)  # while it is late it gets no work
    assert terms["scored_by"] == [0.0] * 12

    processes[1].send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while late.snapshot():
        assert time.monotonic() < deadline, "the thawed replica never rejoined"
        rewards, _, _, _ = pool.score(batch)
        assert rewards.tolist() == right.tolist()
        time.sleep(0.1)
    assert any(r.getMessage().startswith("reward-1 answers again") for r in caplog.records)
    rewards, terms, _, _ = pool.score(batch)
    assert rewards.tolist() == right.tolist() and set(terms["scored_by"]) == {0.0, 1.0}
    pool.close()


def test_with_one_replica_a_frozen_one_is_named_and_waited_for(scorers, caplog):
    caplog.set_level(logging.INFO, logger="test.pool")
    endpoints, processes = scorers(1)
    pool, late = make_pool(endpoints)
    batch, right = samples(5)
    pool.score(batch)
    processes[0].send_signal(signal.SIGSTOP)
    result: list = []
    scoring = threading.Thread(target=lambda: result.append(pool.score(batch)))
    scoring.start()
    deadline = time.monotonic() + 30
    while not late.snapshot():
        assert time.monotonic() < deadline, "the frozen replica was never named"
        time.sleep(0.1)
    assert "reward-0 has not answered for" in late.issue() and "waiting" in late.issue()
    assert not result  # nowhere to move its work: still waiting
    os.kill(processes[0].pid, signal.SIGCONT)
    scoring.join(timeout=30)
    assert result and result[0][0].tolist() == right.tolist()
    assert not late.snapshot()
    assert any(r.getMessage().startswith("reward-0 answers again") for r in caplog.records)
    pool.close()
