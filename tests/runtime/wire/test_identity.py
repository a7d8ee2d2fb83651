"""The launcher -> role contract: actor ranks (one per GPU) in the environment every role process reads."""

from __future__ import annotations

import pytest

from rljob.runtime.wire.identity import (
    COLLOCATED_DATA_PORT,
    COLLOCATED_METRICS_PORT,
    IdentityError,
    RoleIdentity,
    local_identities,
    pod_identity,
    ports_needed,
)

REPLICAS = {"actor": 2, "rollout": 1, "env": 1, "reward": 0}


def local_actors(ranks_per_replica: int) -> list[RoleIdentity]:
    ports = list(range(40000, 40000 + ports_needed(REPLICAS)))
    identities = local_identities("job", REPLICAS, "/tmp/job.yaml", ports, actor_ranks_per_replica=ranks_per_replica)
    return [i for i in identities if i.role == "actor"]


def test_two_replicas_of_two_ranks_are_ranks_0_to_3_of_world_4():
    replicas = local_actors(2)
    assert all(r.starts_ranks for r in replicas)
    envs = [r.for_rank(local).to_env() for r in replicas for local in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "4", "2"),
        ("1", "1", "4", "2"),
        ("2", "0", "4", "2"),
        ("3", "1", "4", "2"),
    ]
    assert [e["RLJOB_REPLICA"] for e in envs] == ["0", "0", "1", "1"]
    # Every rank of a replica shares the replica's ports: only local rank 0 serves the metrics port.
    assert {r.for_rank(1).metrics_port for r in replicas} == {r.metrics_port for r in replicas}


def test_a_replica_that_starts_ranks_has_no_rank_of_its_own():
    replica = local_actors(2)[1]
    env = replica.to_env()
    assert "RANK" not in env and "LOCAL_RANK" not in env
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
    assert RoleIdentity.from_env(env) == replica
    with pytest.raises(IdentityError, match="starts 2 ranks"):
        _ = replica.rank
    with pytest.raises(IdentityError, match="outside"):
        replica.for_rank(2)


def test_each_rank_reads_back_its_identity_from_the_environment():
    for replica in local_actors(2):
        for local in range(2):
            rank = replica.for_rank(local)
            assert RoleIdentity.from_env(rank.to_env()) == rank


def test_one_rank_per_replica_is_the_replica_itself():
    replicas = local_actors(1)
    assert [(r.rank, r.local_rank, r.world_size, r.starts_ranks) for r in replicas] == [
        (0, 0, 2, False),
        (1, 0, 2, False),
    ]
    assert replicas[1].to_env()["RANK"] == "1"
    # An environment from before LOCAL_* existed still reads as one rank per replica.
    legacy = {k: v for k, v in replicas[1].to_env().items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert RoleIdentity.from_env(legacy) == replicas[1]


def test_only_actors_split_into_ranks():
    identity = pod_identity("job", "ns", "rollout", 0, REPLICAS, 9090, actor_ranks_per_replica=8)
    assert (identity.ranks_per_replica, identity.local_rank, identity.starts_ranks) == (1, 0, False)
    assert "WORLD_SIZE" not in identity.to_env()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK 2 is outside LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "3"}, "WORLD_SIZE 3 is not"),
        ({"RANK": "1"}, "RANK 1 is not"),
        ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE must be an integer"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE must be >= 1"),
    ],
)
def test_inconsistent_rank_variables_are_named(changes, message):
    env = {**local_actors(2)[1].for_rank(0).to_env(), **changes}
    with pytest.raises(IdentityError, match=message):
        RoleIdentity.from_env(env)


COLLOCATED = {"actor": 1, "rollout": 1, "env": 0, "reward": 1}


def test_a_collocated_rollout_is_reached_at_its_actor_pod_and_derives_its_identity_from_the_actor():
    actor = pod_identity("job", "ns", "actor", 0, COLLOCATED, 9090, collocated_rollout=True)
    assert actor.endpoints["rollout"] == [f"job-actor-0.job:{COLLOCATED_DATA_PORT}"]
    assert actor.to_env()["RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT"] == str(COLLOCATED_METRICS_PORT)
    assert RoleIdentity.from_env(actor.to_env()) == actor
    rollout = actor.collocated_rollout()
    assert (rollout.role, rollout.replica, rollout.metrics_port) == ("rollout", 0, COLLOCATED_METRICS_PORT)
    assert (rollout.job, rollout.namespace, rollout.config_path) == (actor.job, actor.namespace, actor.config_path)
    assert rollout.endpoints == actor.endpoints and rollout.world_size == 1
    env = rollout.to_env()
    assert "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT" not in env and "RANK" not in env
    assert RoleIdentity.from_env(env) == rollout
    # The other pods of the job reach the rollout where it runs too.
    reward = pod_identity("job", "ns", "reward", 0, COLLOCATED, 9090, collocated_rollout=True)
    assert reward.endpoints == actor.endpoints and reward.collocated_rollout_metrics_port == 0


def test_only_the_process_of_a_collocated_actor_replica_starts_the_rollout_not_its_ranks():
    actor = pod_identity("job", "ns", "actor", 0, COLLOCATED, 9090, actor_ranks_per_replica=2, collocated_rollout=True)
    assert actor.starts_ranks and actor.collocated_rollout().role == "rollout"
    rank = actor.for_rank(1)
    assert "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT" not in rank.to_env()
    with pytest.raises(IdentityError, match="starts no collocated rollout"):
        rank.collocated_rollout()
    with pytest.raises(IdentityError, match="starts no collocated rollout"):
        pod_identity("job", "ns", "actor", 0, COLLOCATED, 9090).collocated_rollout()
