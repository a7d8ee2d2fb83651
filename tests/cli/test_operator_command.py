"""`rljob operator` refuses contradictory or invalid flags before touching any cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import kmock
import pytest
import yaml
from typer.testing import CliRunner

from rljob.api.crd import build_crd
from rljob.cli.main import app
from tests.operator.controller.conftest import NS, Cluster, cartpole_job, eventually, free_port, new_emulator


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--namespace NS (repeatable) or --all-namespaces"),
        (["-n", "a", "--all-namespaces"], "not both"),
        (["-A", "--peering", "x", "--standalone"], "exclude each other"),
        (["-A", "--log-level", "loud"], "--log-level must be one of"),
        (["-A", "--resync-seconds", "0"], "--resync-seconds must be positive"),
        (["-A", "--peering", "x", "--peering-lifetime", "5"], "--peering-lifetime must be at least 12 seconds"),
        (["-A", "--concurrent-reconciles", "0"], "--concurrent-reconciles must be at least 1"),
    ],
)
def test_operator_flags_are_checked(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["operator", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_operator_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_OPERATOR_IMAGE_PULL_POLICY", "Sometimes")
    result = CliRunner().invoke(app, ["operator", "-A"])
    assert result.exit_code == 1
    assert "RLJOB_OPERATOR_IMAGE_PULL_POLICY" in result.output


def test_no_cluster_credentials_is_a_message_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kubernetes_asyncio.config import kube_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    # The default kubeconfig path is read from KUBECONFIG when the module loads: point it at nothing.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig"))
    result = CliRunner().invoke(app, ["operator", "-A", "--log-level", "debug"])
    assert result.exit_code == 1
    assert "no Kubernetes credentials: run in a pod with a ServiceAccount or set KUBECONFIG" in result.output
    assert isinstance(result.exception, SystemExit)  # a clean exit, no ConfigException escaping


@pytest.mark.slow
async def test_operator_command_serves_jobs_from_a_kubeconfig(tmp_path: Path) -> None:
    """The real `rljob operator` process: kubeconfig login, liveness, metrics, and a job's children."""
    kube = new_emulator()
    kube.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"}
    )
    async with kube, kmock.Server(kube) as server:
        kube.create_object(kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, build_crd())
        kube.create_object(kmock.resource("v1", "namespaces"), None, {"metadata": {"name": NS}})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": str(server.url).rstrip("/")}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        liveness, metrics = free_port(), free_port()
        log = tmp_path / "operator.log"
        command = [sys.executable, "-m", "rljob.cli.main", "operator", f"--namespace={NS}", "--log-level=warning"]
        process = subprocess.Popen(
            [*command, f"--liveness-port={liveness}", f"--metrics-port={metrics}"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stderr=log.open("w"),  # a file, not a pipe: nothing blocks when the operator logs a lot
        )
        try:
            cluster = Cluster(kube)
            cluster.create_job(cartpole_job())
            await eventually(lambda: len(cluster.pods("cp")) == 4 or process.poll() is not None, timeout=30)
            assert process.poll() is None, log.read_text()[-2000:]
            # The kubeconfig's token went with the controller's own requests, not only with kopf's.
            creates = [r for r in list(kube) if r.method.value == "POST" and r.resource and r.resource.plural == "pods"]
            tokens = {next((v for k, v in r.headers.items() if k.lower() == "authorization"), None) for r in creates}
            assert creates and tokens == {"Bearer t"}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.get(f"http://127.0.0.1:{liveness}/healthz") as response:
                    assert response.status == 200
                async with session.get(f"http://127.0.0.1:{metrics}/metrics") as response:
                    assert "rljob_operator_reconcile_duration_seconds" in await response.text()
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, timeout=30)
        assert process.returncode == 0, log.read_text()[-2000:]
