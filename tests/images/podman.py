"""podman with the project's settings (images/containers.conf), and why the image tests cannot run when they can't."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf")}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=ENV, check=check, timeout=timeout)


def missing(images: list[str]) -> str | None:
    """Why these images cannot be run here (None when they can)."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are not installed (make image-tools)"
    absent = [image for image in images if podman("image", "exists", image, check=False).returncode != 0]
    return f"not built: {', '.join(absent)} (make images)" if absent else None
