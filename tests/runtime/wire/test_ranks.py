"""An actor replica's ranks: started one per GPU by the replica's process, which ends like one process would."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, EXIT_PREEMPTED, local_identities, ports_needed
from rljob.runtime.wire.ranks import nccl_usage_problem, run_rank_group

REPLICAS = {"actor": 2, "rollout": 1, "env": 1, "reward": 0}


def actor_replica(replica: int, ranks: int):
    ports = list(range(41000, 41000 + ports_needed(REPLICAS)))
    identities = local_identities("job", REPLICAS, "/tmp/job.yaml", ports, actor_ranks_per_replica=ranks)
    return [i for i in identities if i.role == "actor"][replica]


def rank_program(body: str) -> list[str]:
    """A real rank process: python running `body` with RANK/LOCAL_RANK in its environment."""
    return [sys.executable, "-c", "import os, sys, time\n" + textwrap.dedent(body)]


class Output(io.BytesIO):
    def lines(self) -> list[str]:
        return self.getvalue().decode().splitlines()


def run_group(body: str, replica: int = 1, ranks: int = 2) -> tuple[int, list[str]]:
    out = Output()
    code = run_rank_group(actor_replica(replica, ranks), rank_program(body), dict(os.environ), out)
    return code, out.lines()


def test_each_rank_gets_its_rank_and_local_rank_and_its_output_is_prefixed():
    code, lines = run_group(
        """
        e = os.environ
        print(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["RLJOB_REPLICA"])
        """
    )
    assert code == 0
    assert sorted(line for line in lines if line.startswith("rank ")) == ["rank 2 | 2 0 4 2 1", "rank 3 | 3 1 4 2 1"]
    assert "actor[1] started ranks 2..3 of WORLD_SIZE 4 (2 per replica)" in lines


def test_a_preempted_rank_leaves_the_others_to_finish_their_checkpoint_and_the_replica_exits_preempted():
    """Every rank agreed to stop; the first one out must not cut rank 0's checkpoint write short."""
    code, lines = run_group(
        f"""
        import signal
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(1)))
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit({EXIT_PREEMPTED})
        time.sleep(1.5)  # rank 0 writing the checkpoint
        print("checkpoint written", flush=True)
        sys.exit({EXIT_PREEMPTED})
        """
    )
    assert code == EXIT_PREEMPTED, lines
    assert "rank 2 | checkpoint written" in lines
    assert not any("got SIGTERM" in line or "stopping the other ranks" in line for line in lines), lines


def test_a_failed_rank_stops_the_others_and_the_replica_exits_with_its_code():
    code, lines = run_group(
        """
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
        """
    )
    assert code == 3
    assert "actor[1] rank 3 exited with code 3: stopping the other ranks of this replica" in lines


def test_a_rank_stopped_on_a_configuration_error_makes_the_replica_exit_78():
    code, _ = run_group(
        f"""
        if os.environ["LOCAL_RANK"] == "0":
            sys.exit({EXIT_FATAL_CONFIG})
        time.sleep(60)
        """
    )
    assert code == EXIT_FATAL_CONFIG


def test_a_rank_killed_by_a_signal_is_reported_like_a_shell_does():
    code, _ = run_group("os.kill(os.getpid(), 9) if os.environ['LOCAL_RANK'] == '1' else time.sleep(60)")
    assert code == 128 + 9


def test_sigterm_to_the_replica_reaches_every_rank():
    """What Kubernetes does to the pod's first process: the ranks finish and the replica exits with them."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from rljob.runtime.wire.identity import local_identities, ports_needed
        from rljob.runtime.wire.ranks import run_rank_group
        replicas = {REPLICAS!r}
        ports = list(range(41000, 41000 + ports_needed(replicas)))
        replica = [i for i in local_identities("job", replicas, "/tmp/job.yaml", ports, actor_ranks_per_replica=2)
                   if i.role == "actor"][0]
        rank = '''import signal, sys, time, os
        signal.signal(signal.SIGTERM, lambda *_: (print("stopping", flush=True), sys.exit(0)))
        print("up", flush=True)
        time.sleep(60)
        '''
        sys.exit(run_rank_group(replica, [sys.executable, "-c", rank]))
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()},
    )
    assert process.stdout is not None
    seen = []
    while sum("| up" in line for line in seen) < 2:
        line = process.stdout.readline()
        assert line, f"replica ended early: {seen}"
        seen.append(line)
    process.terminate()
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert sorted(line for line in rest.splitlines() if "stopping" in line) == [
        "rank 0 | stopping",
        "rank 1 | stopping",
    ]


def test_a_rank_is_not_a_replica_that_starts_ranks():
    with pytest.raises(ValueError, match="is a rank"):
        run_rank_group(actor_replica(0, 1), rank_program("pass"), {}, Output())


DUPLICATE_GPU = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, invalid usage (run with NCCL_DEBUG=WARN "
    "for details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"
)


def test_two_ranks_on_one_gpu_is_a_configuration_error():
    problem = nccl_usage_problem(dist.DistBackendError(DUPLICATE_GPU))
    assert problem == "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"


def test_nccl_invalid_usage_without_details_is_a_configuration_error():
    problem = nccl_usage_problem(dist.DistBackendError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN)"))
    assert problem == "NCCL error: invalid usage (run with NCCL_DEBUG=WARN)"


@pytest.mark.parametrize(
    "exc",
    [
        dist.DistBackendError("NCCL error: remote process exited or there was a network error, NCCL version 2.21.5"),
        dist.DistBackendError("NCCL error: unhandled system error"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("invalid usage of NCCL"),  # not an error torch.distributed raises
    ],
)
def test_failures_a_restart_may_fix_are_not_configuration_errors(exc):
    assert nccl_usage_problem(exc) is None


def test_the_ranks_of_a_collocated_actor_replica_do_not_start_rollouts_of_their_own():
    """The replica's process runs the collocated rollout (rljob/runtime/roles/collocated.py): not each rank again."""
    out = Output()
    base_env = {**os.environ, "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT": "29603"}
    body = "print(os.environ.get('RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT', 'unset'))"
    assert run_rank_group(actor_replica(0, 2), rank_program(body), base_env, out) == 0
    assert sorted(line for line in out.lines() if line.startswith("rank ")) == ["rank 0 | unset", "rank 1 | unset"]
