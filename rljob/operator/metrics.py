"""Operator metrics in Prometheus form, in their own registry (several operators can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rljob.api.status import PHASES, RLJobStatus

JobStatuses = Callable[[], Iterable[tuple[str, str, RLJobStatus]]]
"""(namespace, name, status) of every RLJob the operator serves, the status as last seen on the API server."""


class _StateCollector(Collector):
    """Gauges computed at scrape time from the controller's view: no bookkeeping to drift."""

    def __init__(
        self,
        phases: Callable[[], Iterable[str]],
        pods: Callable[[], Iterable[tuple[str, str]]],
    ) -> None:
        self.phases = phases
        self.pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("rljob_operator_rljobs", "RLJobs by phase", labels=["phase"])
        counts = dict.fromkeys(PHASES, 0)
        for phase in self.phases():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            jobs.add_metric([phase], count)
        yield jobs
        pods = GaugeMetricFamily("rljob_operator_child_pods", "Child pods by role and phase", labels=["role", "phase"])
        by_key: dict[tuple[str, str], int] = {}
        for key in self.pods():
            by_key[key] = by_key.get(key, 0) + 1
        for (role, phase), count in sorted(by_key.items()):
            pods.add_metric([role, phase], count)
        yield pods


class _JobCollector(Collector):
    """Per-job series from each served RLJob's status, computed at scrape time: a job deleted, or a condition
    turned False, leaves no stale series behind. Labelled `rljob` (not `job`: Prometheus owns that label)."""

    def __init__(self, statuses: JobStatuses) -> None:
        self.statuses = statuses

    def collect(self) -> Iterator[Metric]:
        conditions = GaugeMetricFamily(
            "rljob_operator_rljob_condition",
            "1 for each condition that is True on an RLJob, by type and reason",
            labels=["namespace", "rljob", "type", "reason"],
        )
        rollouts = GaugeMetricFamily(
            "rljob_operator_rljob_rollout_replicas",
            "Rollout replicas the RLJob asks for (status.roles.rollout.desired)",
            labels=["namespace", "rljob"],
        )
        restarts = CounterMetricFamily(
            "rljob_operator_rljob_actor_restarts",
            "Actor-group restarts of an RLJob that counted against maxRestarts (status.restarts)",
            labels=["namespace", "rljob"],
        )
        for namespace, name, status in sorted(self.statuses(), key=lambda item: item[:2]):
            for condition in status.conditions:
                if condition.status == "True":
                    conditions.add_metric([namespace, name, condition.type, condition.reason], 1)
            rollouts.add_metric([namespace, name], status.roles.rollout.desired)
            restarts.add_metric([namespace, name], status.restarts)
        yield conditions
        yield rollouts
        yield restarts


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "rljob_operator_reconcile_duration_seconds",
            "Time of one reconcile of one RLJob, API calls included",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.restarts = Counter(
            "rljob_operator_actor_restarts",
            "Actor-group restarts, by whether they counted against maxRestarts",
            ["counted"],
            registry=self.registry,
        )
        self.replacements = Counter(
            "rljob_operator_pod_replacements",
            "Pods deleted to be replaced, by role and reason",
            ["role", "reason"],
            registry=self.registry,
        )
        self.api_calls = Counter(
            "rljob_operator_api_requests",
            "Kubernetes API requests by verb and HTTP status",
            ["verb", "code"],
            registry=self.registry,
        )
        self.api_errors = Counter(
            "rljob_operator_api_errors",
            "Failed Kubernetes API requests by verb and HTTP status",
            ["verb", "code"],
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "rljob_operator_reconcile_errors", "Reconciles that raised and were retried", registry=self.registry
        )
        self.standby = Gauge(
            "rljob_operator_standby",
            "1 while kopf peering has paused this operator (a hot standby): its job workers do nothing",
            registry=self.registry,
        )
        self.job_pass_seconds = Histogram(
            "rljob_operator_job_pass_seconds",
            "Seconds from the watch event that woke a job's reconcile pass to each stage of the pass "
            "(slot, planned, status_written, pod_created per pod, pods_created, done)",
            ["stage"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.reconcile_queue = Gauge(
            "rljob_operator_reconcile_queue",
            "Job passes waiting for a reconcile slot (granted round robin across namespaces)",
            registry=self.registry,
        )
        self.events_suppressed = Counter(
            "rljob_operator_events_suppressed",
            "Kubernetes Events not posted because their RLJob posted too many lately (rate limit)",
            registry=self.registry,
        )
        self.standby_passes = Counter(
            "rljob_operator_standby_passes",
            "Job-worker passes skipped because the operator stands by",
            registry=self.registry,
        )

    def observe_call(self, verb: str, status: int) -> None:
        self.api_calls.labels(verb, str(status)).inc()
        if status >= 400 or status == 0:
            self.api_errors.labels(verb, str(status)).inc()

    def watch_state(self, phases: Callable[[], Iterable[str]], pods: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self.registry.register(_StateCollector(phases, pods))

    def watch_jobs(self, statuses: JobStatuses) -> None:
        self.registry.register(_JobCollector(statuses))
