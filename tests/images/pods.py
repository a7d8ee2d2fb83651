"""The kubelet's part for the pods `rljob render` prints, on a real container runtime: each Pod becomes a podman
container from its image, on a private network where `<hostname>.<subdomain>` resolves (the headless Service's pod
DNS), with the pod's command, args, env, user, dropped capabilities, volumes and HTTP probes."""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.images.podman import podman

NAMESPACE = "default"


@dataclass
class PodRun:
    """The job's pods as containers; `close()` removes them, their network and volumes."""

    docs: list[dict[str, Any]]
    workdir: Path
    network: str = field(default_factory=lambda: f"rljob-{secrets.token_hex(4)}")
    run_dir: Path | None = None
    """Where the actor writes metrics.jsonl (RLJOB_RUN_DIR, as in tests/multihost/kubelet.py): pods write none."""
    started: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pods = [doc for doc in self.docs if doc["kind"] == "Pod"]
        self.config_maps = {doc["metadata"]["name"]: doc for doc in self.docs if doc["kind"] == "ConfigMap"}
        # The operator makes the job's Secret (a random transport key) at apply time: render does not print it.
        self.secret_data = {"transport-key": secrets.token_hex(32)}

    def start(self) -> None:
        podman("network", "create", self.network)
        for pod in self.pods:
            self.started.append(self._run(pod))

    def _run(self, pod: dict[str, Any]) -> str:
        spec, name = pod["spec"], pod["metadata"]["name"]
        (container,) = spec["containers"]
        security = spec.get("securityContext", {})
        args = ["run", "--detach", "--name", name, "--hostname", spec.get("hostname", name)]
        args += ["--network", self.network, "--network-alias", f"{spec['hostname']}.{spec['subdomain']}"]
        args += ["--user", f"{security['runAsUser']}:{security['runAsGroup']}"]
        if container.get("securityContext", {}).get("capabilities", {}).get("drop") == ["ALL"]:
            args += ["--cap-drop", "ALL"]
        if container.get("securityContext", {}).get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        for variable in container.get("env", []):
            args += ["--env", f"{variable['name']}={self._env_value(pod, variable)}"]
        args += self._mounts(pod, container, security.get("fsGroup"))
        if self.run_dir is not None and pod["metadata"]["labels"].get("rljob.io/role") == "actor":
            self.run_dir.mkdir(parents=True, exist_ok=True)
            os.chown(self.run_dir, security["runAsUser"], security["runAsGroup"])
            args += ["--volume", f"{self.run_dir}:/var/run/rljob/out", "--env", "RLJOB_RUN_DIR=/var/run/rljob/out"]
        command = container.get("command", [])
        if command:
            args += ["--entrypoint", command[0]]
        args += [container["image"], *command[1:], *container.get("args", [])]
        podman(*args)
        return name

    @staticmethod
    def _env_value(pod: dict[str, Any], variable: dict[str, Any]) -> str:
        if "value" in variable:
            return str(variable["value"])
        path = variable["valueFrom"]["fieldRef"]["fieldPath"]
        fields = {"metadata.namespace": NAMESPACE, "metadata.name": pod["metadata"]["name"]}
        if path not in fields:
            raise ValueError(f"{pod['metadata']['name']}: env {variable['name']} from {path} is not emulated")
        return fields[path]

    def _mounts(self, pod: dict[str, Any], container: dict[str, Any], fs_group: int | None) -> list[str]:
        volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
        args: list[str] = []
        for mount in container.get("volumeMounts", []):
            volume, target = volumes[mount["name"]], mount["mountPath"]
            mode = "ro" if mount.get("readOnly") else "rw"
            if "configMap" in volume:
                data = self.config_maps[volume["configMap"]["name"]]["data"]
                args += ["--volume", f"{self._files(pod, mount['name'], data, 0o444, fs_group)}:{target}:{mode}"]
            elif "secret" in volume:
                files = self._files(pod, mount["name"], self.secret_data, volume["secret"]["defaultMode"], fs_group)
                args += ["--volume", f"{files}:{target}:{mode}"]
            elif "persistentVolumeClaim" in volume:
                claim = f"{self.network}-{volume['persistentVolumeClaim']['claimName']}"
                if claim not in self.volumes:
                    podman("volume", "create", claim)
                    self.volumes.append(claim)
                args += ["--volume", f"{claim}:{target}:{mode},U"]  # fsGroup: the pod's user owns the volume
            elif "emptyDir" in volume:
                args += ["--mount", f"type=tmpfs,destination={target},tmpfs-mode=1777"]
            else:
                raise ValueError(f"{pod['metadata']['name']}: volume {mount['name']} is not emulated: {volume}")
        return args

    def _files(self, pod: dict[str, Any], volume: str, data: dict[str, str], mode: int, gid: int | None) -> Path:
        folder = self.workdir / pod["metadata"]["name"] / volume
        folder.mkdir(parents=True)
        for key, text in data.items():
            (folder / key).write_text(text)
            (folder / key).chmod(mode)
            if gid is not None:
                os.chown(folder / key, 0, gid)  # the kubelet gives fsGroup the volume's files
        return folder

    def address(self, name: str) -> str:
        networks = json.loads(podman("inspect", name, "--format", "{{json .NetworkSettings.Networks}}").stdout)
        return networks[self.network]["IPAddress"]

    def probe(self, pod: dict[str, Any], kind: str) -> bool | None:
        """One HTTP probe of the pod's container, as the kubelet makes it (None when the pod has no such probe)."""
        (container,) = pod["spec"]["containers"]
        spec = container.get(kind)
        if spec is None:
            return None
        ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        port = spec["httpGet"]["port"]
        url = f"http://{self.address(pod['metadata']['name'])}:{ports.get(port, port)}{spec['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=spec.get("timeoutSeconds", 1)) as response:
                return 200 <= response.status < 400
        except OSError:
            return False

    def exit_code(self, name: str) -> int | None:
        state = podman("inspect", name, "--format", "{{.State.Status}} {{.State.ExitCode}}").stdout.split()
        return int(state[1]) if state[0] in {"exited", "stopped"} else None

    def wait(self, name: str, limit_s: float, every_s: float = 2.0) -> tuple[int | None, dict[str, set[str]]]:
        """Probes every pod until `name` exits; returns its exit code and, per probe kind, the pods it found healthy."""
        healthy: dict[str, set[str]] = {"startupProbe": set(), "readinessProbe": set(), "livenessProbe": set()}
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for pod in self.pods:
                if self.exit_code(pod["metadata"]["name"]) is None:
                    for kind, found in healthy.items():
                        if self.probe(pod, kind):
                            found.add(pod["metadata"]["name"])
            code = self.exit_code(name)
            if code is not None:
                return code, healthy
            time.sleep(every_s)
        return None, healthy

    def logs(self, name: str) -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    def close(self) -> None:
        for name in self.started:
            podman("rm", "--force", "--time", "5", name, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "--force", volume, check=False)
        podman("network", "rm", "--force", self.network, check=False)
