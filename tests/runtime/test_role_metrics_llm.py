"""The llm actor's step record in Prometheus form: throughput and the generate/reward/train/sync split."""

from prometheus_client import generate_latest

from rljob.runtime.records.metrics import RoleMetrics


def test_an_llm_step_exports_tokens_per_second_and_its_own_phases():
    metrics = RoleMetrics("arithmetic", "actor", 0)
    metrics.observe(
        {
            "step": 3,
            "reward_mean": 0.5,
            "tokens_per_s": 1250.0,
            "time_generate_s": 0.4,
            "time_reward_s": 0.05,
            "time_train_s": 0.3,
            "time_sync_s": 0.1,
        }
    )
    text = generate_latest(metrics.registry).decode()
    assert "rljob_tokens_per_second 1250.0" in text
    for phase, seconds in (("generate", 0.4), ("reward", 0.05), ("train", 0.3), ("sync", 0.1)):
        assert f'rljob_step_phase_seconds{{phase="{phase}"}} {seconds}' in text
    assert 'phase="rollout"' not in text  # a gym phase the llm loop does not have stays unset
