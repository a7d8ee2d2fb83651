"""What `make images` built, run by a real OCI runtime (podman + runc) as the Dockerfiles' non-root user; skipped,
with the reason, where the tools or the images are missing."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from rljob import __version__
from rljob.cli.main import app
from tests.images.podman import ROOT, missing, podman
from tests.images.pods import PodRun

REGISTRY = "ghcr.io/rljob"
CPU_IMAGES = {name: f"{REGISTRY}/{name}:{__version__}" for name in ("operator", "env", "trainer")}


def need(*names: str) -> list[str]:
    images = [CPU_IMAGES[name] for name in names]
    reason = missing(images)
    if reason:
        pytest.skip(reason)
    return images


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("operator", ["version"], __version__),
        ("operator", ["operator", "--help"], "Run the operator"),
        ("env", ["version"], __version__),
        ("env", ["role", "--help"], "ROLE"),
        ("trainer", ["version"], __version__),
        ("trainer", ["role", "--help"], "ROLE"),
    ],
)
def test_entrypoint_runs_as_the_non_root_user(name, args, expected):
    (image,) = need(name)
    result = podman("run", "--rm", "--network", "none", image, *args, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout
    who = podman("run", "--rm", "--network", "none", "--entrypoint", "id", image).stdout
    assert who.startswith("uid=1000(rljob) gid=1000(rljob)")


@pytest.mark.parametrize("name", sorted(CPU_IMAGES))
def test_image_is_labelled_with_its_source_version_and_revision(name):
    (image,) = need(name)
    labels = podman("image", "inspect", image, "--format", "{{json .Labels}}").stdout
    labels = yaml.safe_load(labels)
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.source"].startswith("https://")
    revision = labels["org.opencontainers.image.revision"]
    assert len(revision) == 40 and revision != "unknown", "make images passes VCS_REF=$(git rev-parse HEAD)"


def test_cartpole_pods_run_as_containers_until_the_actor_succeeds(tmp_path):
    need("env", "trainer")
    result = CliRunner().invoke(app, ["render", str(ROOT / "examples" / "cartpole-ppo.yaml")])
    assert result.exit_code == 0, result.output
    rendered = result.stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    run = PodRun(docs, tmp_path, run_dir=tmp_path / "out")
    try:
        run.start()
        code, healthy = run.wait("cartpole-ppo-actor-0", limit_s=900)
        log = run.logs("cartpole-ppo-actor-0")
        assert code == 0, log[-4000:]
    finally:
        run.close()
    pods = {pod["metadata"]["name"] for pod in run.pods}
    assert pods == {"cartpole-ppo-actor-0", "cartpole-ppo-rollout-0", "cartpole-ppo-env-0"}
    assert "cartpole-ppo-actor-0" in healthy["readinessProbe"], "the actor's /healthz answered on its metrics port"
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    returns = [r["return_mean"] for r in records[-10:] if r.get("return_mean") is not None]
    assert sum(returns) / len(returns) > 150, returns  # it learns (500 with every role a local process)
