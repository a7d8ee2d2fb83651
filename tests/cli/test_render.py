"""`rljob render`: the resolved job, then exactly the manifests the operator creates."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from rljob.api import load_job_file
from rljob.cli.main import app
from rljob.operator.manifests import build_children
from rljob.operator.settings import OperatorSettings
from tests.conftest import REPO

EXAMPLES = Path(__file__).parents[2] / "examples"
H100_JOB = EXAMPLES / "grpo-qwen-math-h100.yaml"


def render(*args: str):
    return CliRunner().invoke(app, ["render", *args])


def test_render_prints_the_resolved_job_then_every_child(monkeypatch):
    monkeypatch.delenv("RLJOB_OPERATOR_TRAINER_IMAGE", raising=False)
    result = render(str(H100_JOB))
    assert result.exit_code == 0, result.output
    documents = list(yaml.safe_load_all(result.stdout))
    assert documents[0]["kind"] == "RLJob" and documents[0]["spec"]["roles"]["env"]["replicas"] == 0
    job = load_job_file(H100_JOB)
    assert documents[1:] == build_children(job, OperatorSettings())
    kinds = [d["kind"] for d in documents]
    assert kinds == ["RLJob", "ConfigMap", "Service", "PodGroup", "NetworkPolicy"] + ["Pod"] * 8


def test_render_only_job_or_only_children():
    (job,) = yaml.safe_load_all(render("--only", "job", str(H100_JOB)).stdout)
    assert job["kind"] == "RLJob" and "status" not in job
    children = list(yaml.safe_load_all(render("--only", "children", str(H100_JOB)).stdout))
    assert children[0]["kind"] == "ConfigMap" and len(children) == 12


def test_render_shows_both_policies_of_a_code_exec_job():
    children = list(yaml.safe_load_all(render("--only", "children", str(EXAMPLES / "grpo-tiny-code.yaml")).stdout))
    kinds = [c["kind"] for c in children]
    assert kinds == ["ConfigMap", "Service", "PersistentVolumeClaim", "NetworkPolicy", "NetworkPolicy"] + ["Pod"] * 3
    assert children[2]["metadata"]["name"] == "grpo-tiny-code-checkpoints"  # its model is exported there
    assert children[3]["metadata"]["name"] == "grpo-tiny-code-isolation"
    assert children[4]["metadata"]["name"] == "grpo-tiny-code-reward-egress"


def test_render_uses_the_operator_image_settings(monkeypatch):
    monkeypatch.setenv("RLJOB_OPERATOR_TRAINER_IMAGE", "registry.local/trainer:7")
    pods = [d for d in yaml.safe_load_all(render("--only", "children", str(H100_JOB)).stdout) if d["kind"] == "Pod"]
    assert pods[0]["spec"]["containers"][0]["image"] == "registry.local/trainer:7"


def test_render_reports_a_clash_with_the_field_to_change(tmp_path):
    text = (EXAMPLES / "cartpole-ppo.yaml").read_text() + "  logging:\n    prometheusPort: 29500\n"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(text)
    result = render(str(manifest))
    assert result.exit_code == 1
    assert "spec.logging.prometheusPort" in result.output and "choose another port" in result.output


def test_render_shows_each_roles_probes_from_its_spec(tmp_path):
    text = (EXAMPLES / "cartpole-ppo.yaml").read_text()
    job = yaml.safe_load(text)
    job["spec"]["roles"]["env"]["probes"] = {"livenessTimeoutSeconds": 60, "startupTimeoutSeconds": 20}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    documents = list(yaml.safe_load_all(render(str(manifest)).stdout))
    assert documents[0]["spec"]["roles"]["env"]["probes"] == {"livenessTimeoutSeconds": 60, "startupTimeoutSeconds": 20}
    env_pods = [d for d in documents if d["kind"] == "Pod" and d["metadata"]["labels"]["rljob.io/role"] == "env"]
    assert env_pods
    for pod in env_pods:
        (main,) = pod["spec"]["containers"]
        assert main["startupProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
        assert main["startupProbe"]["failureThreshold"] == 4
        assert main["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}


def test_render_shows_only_the_builtin_settings_its_architecture_reads():
    from rljob.api.spec import BuiltinNetwork
    from rljob.api.view import _BUILTIN_FIELDS_READ

    def builtin_of(example: str) -> dict:
        result = CliRunner().invoke(app, ["render", str(REPO / "examples" / example), "--only", "job"])
        assert result.exit_code == 0, result.output
        return yaml.safe_load(result.stdout)["spec"]["model"].get("builtin")

    assert set(builtin_of("cartpole-ppo.yaml")) == {"architecture", "hiddenSizes", "activation"}
    assert set(builtin_of("grpo-tiny-arithmetic.yaml")) == {"architecture", "hiddenSize", "numLayers", "numHeads"}
    assert "patchSize" in builtin_of("grpo-vlm-tiny-shapes.yaml")
    assert builtin_of("grpo-qwen-math-h100.yaml") is None  # a hub model: no builtin network at all
    every = {f.alias or name for name, f in BuiltinNetwork.model_fields.items()}
    assert every == set().union(*_BUILTIN_FIELDS_READ.values())  # a new field must say which architecture reads it
