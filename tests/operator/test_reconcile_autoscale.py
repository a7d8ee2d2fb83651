"""The reconciler's rollout autoscaling: the actor's signal in, a scale through the subresource out, once."""

from __future__ import annotations

from typing import Any

from rljob.api import load_job_file, validate_job
from rljob.api.status import AutoscaleStatus, Progress, RLJobStatus, ScaleSample
from rljob.operator.reconcile import plan
from rljob.operator.status import rfc3339
from tests.operator.test_reconcile import LLM_EXAMPLE, NOW, observe, running_llm_pods, seconds

AUTOSCALE = {"minReplicas": 1, "maxReplicas": 4, "targetTrainerWait": 0.2, "scaleUpCooldownSeconds": 60}


def autoscaled_job(rollouts: int = 1, **autoscale: Any):
    data = load_job_file(LLM_EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["metadata"] = {"name": "ar", "namespace": "ns", "uid": "u-2", "generation": 1}
    data["spec"]["rollout"]["engine"] = "hf"
    data["spec"]["roles"]["rollout"]["replicas"] = rollouts
    data["spec"]["roles"]["rollout"]["autoscale"] = {**AUTOSCALE, **autoscale}
    return validate_job(data)


def step(n: int, wait: float, idle: float = 0.0) -> Progress:
    return Progress(step=n, total_steps=100, trainer_wait=wait, rollout_idle=idle, updated_at=rfc3339(NOW))


def test_a_waiting_trainer_scales_the_rollouts_up_once_with_an_event_and_status():
    the_job = autoscaled_job(1)
    status = RLJobStatus(phase="Running")
    first = plan(observe(status, running_llm_pods(1), the_job=the_job, progress=step(1, 0.6)))
    assert first.scale_rollouts is None  # one step is no trend
    assert first.status.autoscale is not None and first.status.autoscale.replicas == 1
    second = plan(observe(first.status, running_llm_pods(1), the_job=the_job, progress=step(2, 0.6), now=NOW))
    assert second.scale_rollouts == 2
    events = [e for e in second.events if e.reason == "ScaledRollouts"]
    assert len(events) == 1 and events[0].type == "Normal"
    assert "waited 60% of its last 2 steps for generations (target 20%): 1 -> 2 rollouts" in events[0].message
    state = second.status.autoscale
    assert (state.replicas, state.last_scale_direction, state.last_scale_step) == (2, "Up", 2)
    assert state.last_scale_time == rfc3339(NOW)
    # The same observation again (a stale cache, an operator restart after the status write): nothing more.
    replay = plan(observe(second.status, running_llm_pods(1), the_job=the_job, progress=step(2, 0.6), now=NOW))
    assert replay.scale_rollouts is None and not [e for e in replay.events if e.reason == "ScaledRollouts"]


def test_the_cooldown_counts_from_the_scaling_kept_in_status():
    status = RLJobStatus(phase="Running")
    for n in (1, 2):
        status = plan(observe(status, running_llm_pods(1), the_job=autoscaled_job(1), progress=step(n, 0.6))).status
    # Scaled to 2 at NOW; steps 3 and 4 still wait: held until 60 s have passed.
    scaled = autoscaled_job(2)
    for n in (3, 4):
        held = plan(observe(status, running_llm_pods(2), the_job=scaled, progress=step(n, 0.5), now=NOW + seconds(30)))
        status = held.status
    assert held.scale_rollouts is None and held.status.autoscale.replicas == 2
    later = plan(observe(status, running_llm_pods(2), the_job=scaled, now=NOW + seconds(61)))
    assert later.scale_rollouts == 4  # ceil(2 * 0.5 / 0.2) = 5, at most doubling


def test_idle_rollouts_are_scaled_down_one_at_a_time():
    the_job = autoscaled_job(3, scaleDownCooldownSeconds=0)
    status = RLJobStatus(phase="Running")
    for n in (1, 2):
        result = plan(observe(status, running_llm_pods(3), the_job=the_job, progress=step(n, 0.02, 0.8)))
        status = result.status
    assert result.scale_rollouts == 2 and status.autoscale.last_scale_direction == "Down"


def test_a_hand_scaled_count_outside_the_bounds_goes_back_to_them():
    result = plan(observe(RLJobStatus(phase="Running"), running_llm_pods(1), the_job=autoscaled_job(7)))
    assert result.scale_rollouts == 4
    assert [e.message for e in result.events if e.reason == "ScaledRollouts"] == [
        "7 rollouts is above autoscale.maxReplicas 4: 7 -> 4"
    ]


def test_without_autoscale_nothing_is_scaled_and_no_state_is_kept():
    data = load_job_file(LLM_EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["metadata"] = {"name": "ar", "namespace": "ns", "uid": "u-2", "generation": 1}
    data["spec"]["rollout"]["engine"] = "hf"
    result = plan(
        observe(RLJobStatus(phase="Running"), running_llm_pods(1), the_job=validate_job(data), progress=step(1, 0.9))
    )
    assert result.scale_rollouts is None and result.status.autoscale is None
    assert result.status.progress.trainer_wait == 0.9  # the signal is still reported


def test_the_scale_subresource_selects_the_rollout_pods_for_an_hpa():
    from rljob.api.crd import build_crd
    from rljob.operator.manifests import build_children
    from rljob.operator.settings import OperatorSettings

    scale = build_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["labelSelectorPath"] == ".status.rolloutSelector"
    the_job = autoscaled_job(2)
    selector = plan(observe(RLJobStatus(phase="Running"), running_llm_pods(2), the_job=the_job)).status.rollout_selector
    wanted = dict(term.split("=") for term in selector.split(","))
    selected = [
        c["metadata"]["name"]
        for c in build_children(the_job, OperatorSettings())
        if c["kind"] == "Pod" and wanted.items() <= c["metadata"]["labels"].items()
    ]
    assert selected == ["ar-rollout-0", "ar-rollout-1"]


def test_outside_running_only_the_bounds_apply_whatever_the_old_samples_say():
    """After a restart or a resume from suspend the kept samples are old: they scale nothing until steps come."""
    old = [ScaleSample(step=n, trainer_wait=0.6, rollout_idle=0.0) for n in (1, 2)]  # would scale up while Running
    status = RLJobStatus(phase="Restarting", autoscale=AutoscaleStatus(replicas=1, samples=old))
    restarting = plan(observe(status, running_llm_pods(1), the_job=autoscaled_job(1), progress=step(2, 0.6)))
    assert restarting.scale_rollouts is None
    below_min = plan(observe(status, running_llm_pods(1), the_job=autoscaled_job(1, minReplicas=2)))
    assert below_min.scale_rollouts == 2  # the bounds are the user's: applied in any phase
