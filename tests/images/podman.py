"""podman with the project's settings (images/containers.conf), and why the image tests cannot run when they can't."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf")}


class PodmanFailed(AssertionError):
    """A podman command that had to succeed did not; its message ends with what podman said."""


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, env=ENV, timeout=timeout)
    if check and done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no message")[-2000:]
        raise PodmanFailed(f"podman {args[0]} exited with code {done.returncode}: {said}")
    return done


def missing(images: list[str]) -> str | None:
    """Why these images cannot be run here (None when they can)."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are not installed (make image-tools)"
    absent = [image for image in images if podman("image", "exists", image, check=False).returncode != 0]
    if absent:
        return f"not built: {', '.join(absent)} (make images)"
    stale = [image for image in images if not built_from_these_sources(image)]
    if stale:
        return f"built from older sources: {', '.join(stale)} (make images)"
    return runtime_problem(images[0])


@functools.cache
def runtime_problem(image: str) -> str | None:
    """Why podman cannot run a container on this host (a sandbox without the namespaces or cgroups a runtime
    needs), or None: the images were built, so the tools are there, but building needs no runtime."""
    probe = podman("run", "--rm", "--network", "none", "--entrypoint", "/bin/true", image, check=False)
    if probe.returncode == 0:
        return None
    said = (probe.stderr.strip().splitlines() or ["no message"])[-1]
    return f"podman cannot run a container on this host: {said}"


IMAGE_SOURCES = (
    "rljob",
    "pyproject.toml",
    "constraints",
    "images",
    "operator",
    "trainer_image",
    "rollout_image",
    "env_image",
)
"""What an image is built from: when any of it changed since the image's revision, the image runs old code."""


def built_from_these_sources(image: str) -> bool:
    """Whether the image's `org.opencontainers.image.revision` has the checkout's image sources (committed or not)."""
    revision = podman("image", "inspect", image, "--format", '{{index .Labels "org.opencontainers.image.revision"}}')
    ref = revision.stdout.strip()
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}^{{commit}}"], capture_output=True)
    if not ref or known.returncode != 0:
        return False
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", ref, "--", *IMAGE_SOURCES], capture_output=True
    )
    return changed.returncode == 0
