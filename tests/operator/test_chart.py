"""Static checks of the Helm chart that CI can run without a helm binary.

The chart is also checked with real Helm (`helm lint --strict`, `helm template`, install) outside CI;
these tests keep what can be checked offline honest: values against the schema, templates that are
well-formed Go templates over YAML using only Helm/sprig functions, RBAC equal to the API calls the
operator declares, the generated CRD in sync, and every operator setting wired to a value.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml

from rljob import __version__
from rljob.api.crd import crd_yaml
from rljob.cli.main import app
from rljob.operator.rbac import OPERATOR_API_ACCESS, ApiAccess
from rljob.operator.settings import ENV_PREFIX, OperatorSettings

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "rljob-operator"
TEMPLATES = CHART / "templates"
ACTION = re.compile(r"{{-?\s*(.*?)\s*-?}}", re.S)
COMMENT = re.compile(r"{{-?\s*/\*.*?\*/\s*-?}}", re.S)

# Go template built-ins, Helm's own functions and the sprig functions the chart may use.
ALLOWED_FUNCTIONS = {
    "if", "else", "end", "range", "with", "define", "template", "block", "not", "and", "or", "eq", "ne",
    "len", "index", "print", "printf", "include", "tpl", "required", "toYaml", "fail", "default", "quote",
    "trunc", "trimSuffix", "replace", "contains", "join", "list", "append", "get", "nindent", "indent", "empty",
}  # fmt: skip


class UniqueKeyLoader(yaml.SafeLoader):
    """Duplicate keys are errors: two branches leaking into one document must not pass silently."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    assert len(keys) == len(set(keys)), f"duplicate keys at line {node.start_mark.line + 1}: {keys}"
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema_validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def template_files() -> list[Path]:
    return sorted(p for p in TEMPLATES.glob("*.yaml"))


def _block_heads(line: str) -> list[str]:
    """The block keywords (if, else, end, ...) of a line made only of actions; [] for other lines."""
    actions = ACTION.findall(line)
    if not actions or ACTION.sub("", line).strip():
        return []
    return [(a.split() or [""])[0] for a in actions] or [""]


def skeleton(text: str, branch: str = "if") -> str:
    """The YAML left when actions are dropped: action-only lines go, inline actions become a word.

    Of every `if` with an `else`, only the `branch` side is kept (an `if` without `else` keeps its body),
    so each side of a conditional is checked as the document Helm would render.
    """
    lines = COMMENT.sub("", text).splitlines()
    has_else, opened = set(), []
    for number, line in enumerate(lines):
        for head in _block_heads(line):
            if head in ("if", "range", "with", "define", "block"):
                opened.append((head, number))
            elif head == "else" and opened[-1][0] == "if":
                has_else.add(opened[-1][1])
            elif head == "end":
                opened.pop()
    kept, stack = [], []  # stack: per open block, whether its current side is kept
    for number, line in enumerate(lines):
        heads = _block_heads(line)
        for head in heads:
            if head in ("if", "range", "with", "define", "block"):
                stack.append(head != "if" or number not in has_else or branch == "if")
            elif head == "else":
                stack[-1] = branch == "else"
            elif head == "end":
                stack.pop()
        if not heads and all(stack):
            kept.append(ACTION.sub("TEMPLATED", line))
    return "\n".join(kept)


def defined_rules(name: str) -> list[dict]:
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    match = re.search(r'{{-? define "' + re.escape(name) + r'" -?}}\n(.*?){{-? end }}', helpers, re.S)
    assert match, f"_helpers.tpl defines {name}"
    assert "{{" not in match.group(1), f"{name} must be plain YAML"
    return yaml.safe_load(match.group(1))


def as_access(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def declared(accesses: list[ApiAccess]) -> dict[tuple[str, str], set[str]]:
    return {(a.group, a.resource): set(a.verbs) for a in accesses}


# --- values ---------------------------------------------------------------------------------------


def test_default_values_validate_against_the_values_schema():
    schema_validator().validate(load_values())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"replicas": 2}, "is greater than the maximum of 1"),
        ({"replicas": 2, "peering": {"enabled": True, "name": "Bad Name"}}, "does not match"),
        ({"peering": {"enabled": True, "name": "rljob", "lifetimeSeconds": 5}}, "less than the minimum of 12"),
        ({"watchNamespaces": ["Research"]}, "does not match"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "is not one of"),
        ({"jobDefaults": {"runAsUser": 0}}, "less than the minimum of 1"),
        ({"metrics": {"prot": 9090}}, "Additional properties are not allowed"),
        ({"unknownKey": True}, "Additional properties are not allowed"),
    ],
)
def test_the_values_schema_rejects_bad_values_with_a_reason(change, message):
    values = {**load_values(), **change}
    errors = [e.message for e in schema_validator().iter_errors(values)]
    assert any(message in e for e in errors), errors


def test_a_hot_standby_is_allowed_with_peering():
    schema_validator().validate({**load_values(), "replicas": 2, "peering": {"enabled": True, "name": "rljob"}})


# --- chart, CRDs ----------------------------------------------------------------------------------


def test_chart_metadata_is_helm_3_and_tracks_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == CHART.name
    assert chart["appVersion"] == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_chart_crd_is_the_generated_one():
    generated = crd_yaml()
    assert (CHART / "crds" / "rljob.io_rljobs.yaml").read_text() == generated, "run `make crds`"
    assert (ROOT / "crds" / "rljob.io_rljobs.yaml").read_text() == generated, "run `make crds`"


def test_every_chart_crd_is_a_valid_custom_resource_definition():
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(document, "1.33", strict=True)


# --- templates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [*template_files(), TEMPLATES / "_helpers.tpl", TEMPLATES / "NOTES.txt"], ids=str)
def test_templates_balance_their_blocks_and_use_only_helm_functions(path):
    text = COMMENT.sub("", path.read_text())
    depth = 0
    for action in ACTION.findall(text):
        words = re.sub(r'"[^"]*"', '""', action).split()
        head = words[0] if words else ""
        if head in ("if", "range", "with", "define", "block"):
            depth += 1
        elif head == "end":
            depth -= 1
            assert depth >= 0, f"unbalanced end in {path.name}"
        called = set(re.findall(r"(?:^|[\s(|])([A-Za-z][A-Za-z0-9]*)\b", re.sub(r'"[^"]*"', "", action)))
        assert called <= ALLOWED_FUNCTIONS, f"{path.name}: {called - ALLOWED_FUNCTIONS} in {{{{ {action} }}}}"
    assert depth == 0, f"unclosed block in {path.name}"


@pytest.mark.parametrize("branch", ["if", "else"])
@pytest.mark.parametrize("path", template_files(), ids=lambda p: p.name)
def test_templates_are_kubernetes_objects_once_actions_are_dropped(path, branch):
    documents = [d for d in yaml.load_all(skeleton(path.read_text(), branch), Loader=UniqueKeyLoader) if d]
    assert documents
    for document in documents:
        assert {"apiVersion", "kind", "metadata"} <= set(document), document
        assert document["metadata"]["name"]


def test_deployment_runs_one_operator_replaced_by_recreate():
    (deployment,) = yaml.safe_load_all(skeleton((TEMPLATES / "deployment.yaml").read_text()))
    assert deployment["kind"] == "Deployment" and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert load_values()["replicas"] == 1
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["name"] for p in container["ports"]} == {"health", "metrics"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_every_operator_setting_is_set_by_the_chart():
    (deployment,) = yaml.safe_load_all(skeleton((TEMPLATES / "deployment.yaml").read_text()))
    env = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    wanted = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(OperatorSettings)}
    assert wanted <= env, wanted - env


# --- RBAC -----------------------------------------------------------------------------------------


def test_rbac_grants_exactly_the_declared_api_calls_and_no_wildcards():
    rules = {
        scope: defined_rules(f"rljob-operator.rules.{scope}")
        for scope in ("namespaced", "cluster", "peering.namespaced", "peering.cluster")
    }
    for block in rules.values():
        for rule in block:
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]

    def chosen(scope: str, peering: bool) -> list[ApiAccess]:
        return [a for a in OPERATOR_API_ACCESS if a.scope == scope and a.peering_only == peering]

    assert as_access(rules["namespaced"]) == declared(chosen("namespaced", False))
    assert as_access(rules["cluster"]) == declared(chosen("cluster", False))
    assert as_access(rules["peering.namespaced"]) == declared(chosen("namespaced", True))
    assert as_access(rules["peering.cluster"]) == declared(chosen("cluster", True))


def test_rbac_modes_bind_the_right_rule_blocks():
    text = (TEMPLATES / "rbac.yaml").read_text()
    all_namespaces, _, namespaced = text.partition("{{- else }}")
    assert "if not .Values.watchNamespaces" in all_namespaces
    for block in ("rules.namespaced", "rules.cluster", "rules.peering.cluster"):
        assert block in all_namespaces
    cluster_role, _, per_namespace = namespaced.partition("range $namespace := .Values.watchNamespaces")
    assert "rules.cluster" in cluster_role and "rules.namespaced" not in cluster_role
    assert "kind: Role\n" in per_namespace and "rules.namespaced" in per_namespace
    assert "rules.peering.namespaced" in per_namespace


@pytest.mark.parametrize("branch", ["if", "else"])
def test_deployment_args_are_options_of_rljob_operator(branch):
    (deployment,) = yaml.safe_load_all(skeleton((TEMPLATES / "deployment.yaml").read_text(), branch))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "operator"
    command = typer.main.get_command(app).commands["operator"]
    options = {opt for param in command.params for opt in param.opts}
    flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
    assert flags and set(flags) <= options, set(flags) - options
