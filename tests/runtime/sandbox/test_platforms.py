"""The sandbox's containment battery on the platforms this test process is not: in a reward pod (the container
runtime's RuntimeDefault seccomp profile refuses namespaces) and as an unprivileged user (this machine and CI
run tests as root). Each runs tests/runtime/sandbox/battery.py in a process made for it and checks every
case is contained: a counted error naming the limit, the good run beside it scoring 1, nothing left running.

When the tests themselves run as a non-root user, tests/runtime/sandbox/test_runner.py already covers the
unprivileged path (both isolation modes) and the tests here that need root to change uid are skipped."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.runtime.sandbox import runtime_default_seccomp
from tests.runtime.sandbox.battery import CASES, LAUNCH_SECRET

# These look at the whole machine (every process under a sandbox uid, the shared TMPDIR): `make test` runs
# them alone, after the parallel part of the suite.
pytestmark = pytest.mark.serial

NOBODY = 65534
CONTAINED = {
    # Which limit stops a busy loop first depends on the CPU it gets (see test_sandbox.py).
    "infinite_loop": ("killed after the wall-clock limit", "CPU time limit"),
    "sigterm_ignoring_escapee": ("killed after the wall-clock limit",),
    "fork_bomb": ("process limit reached",),
    "memory_bomb": ("out of memory",),
    "network": ("network access refused",),
    "write_outside": ("write outside the working directory refused",),
}
needs_linux_seccomp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not runtime_default_seccomp.supported(),
    reason="the RuntimeDefault seccomp fixture knows the syscall numbers of Linux x86_64 and aarch64 only",
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="changing uid needs root; as non-root, tests/runtime/sandbox/test_runner.py covers the unprivileged path",
)


@contextlib.contextmanager
def battery_directory() -> Iterator[Path]:
    """Where a battery's runs work: reachable by a run's own uid (as root a run drops to one), owned by
    the uid the battery runs as. Not under pytest's tmp_path, whose parent only its owner may enter."""
    base = Path(tempfile.mkdtemp(prefix="rljob-battery-"))
    try:
        base.chmod(0o755)
        (base / "tmp").mkdir(mode=0o755)
        (base / "staging").mkdir()
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def battery_dir() -> Iterator[Path]:
    with battery_directory() as base:
        yield base


@pytest.fixture(scope="module")
def seccomp_report() -> dict:
    """The battery as this process's uid under the RuntimeDefault fixture, run once for the tests that read it."""
    with battery_directory() as base:
        return battery(base, "auto", seccomp="runtime-default", uid=None)


def battery(base: Path, isolation: str, *, seccomp: str | None, uid: int | None) -> dict:
    """Runs the battery (as `uid` when given, through tests/runtime/sandbox/as_unprivileged.py); returns its report."""
    command = [sys.executable, "-m", "tests.runtime.sandbox.battery", "--isolation", isolation]
    command += ["--tmp", str(base / "tmp")] + (["--seccomp", seccomp] if seccomp else [])
    if uid is not None:
        os.chown(base / "tmp", uid, uid)
        # What the interpreter, its packages and this checkout need, wherever CI put them.
        needed = {sys.base_prefix, sys.prefix, str(REPO), *(p for p in sys.path if p and os.path.isdir(p))}
        launcher = [sys.executable, str(REPO / "tests" / "runtime" / "sandbox" / "as_unprivileged.py"), str(uid)]
        command = [*launcher, str(base / "staging"), *sorted(needed), "--", *command]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(base / "tmp"),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "RLJOB_TEST_LAUNCH_SECRET": LAUNCH_SECRET,  # in the battery's environment from its start, like a pod's
    }
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode == 77 and uid is not None:
        pytest.skip(f"the interpreter or checkout is unreadable for uid {uid}: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def assert_contained(report: dict) -> None:
    cases = report["cases"]
    assert set(cases) == set(CASES)
    for name, reasons in CONTAINED.items():
        case = cases[name]
        assert case["error"] is not None and any(r in case["error"] for r in reasons), (name, case)
        assert case["good_score"] == 1.0, (name, case)  # the reward process keeps serving
        assert case["leftovers"] == [], (name, case)
    assert cases["write_outside"]["target_exists"] is False
    secret = cases["secret_env"]
    assert secret["error"] is None and secret["total"] == 2, secret
    own_uid_or_namespaced = secret["namespaced"] or secret["uid"] != report["uid"]
    if own_uid_or_namespaced:
        assert secret["passed"] == 2, secret  # neither secret is anywhere the run can look
    else:
        # The unprivileged fallback shares the reward process's uid, so the run may read the environment the
        # reward process started with in /proc (docs/sandbox.md says so); its inherited environment is clean.
        assert secret["crash"] in (None, "AssertionError: launch"), secret


def namespaced_runs(report: dict) -> set[bool]:
    return {case["good_namespaced"] for case in report["cases"].values()}


# --- in a pod: the RuntimeDefault seccomp profile refuses namespaces ------------------------------------


@needs_linux_seccomp
def test_the_runtime_default_seccomp_fixture_refuses_namespaces_as_the_profile_does(seccomp_report):
    assert seccomp_report["kernel_answers"] == {
        "unshare": "EPERM",
        "clone_newnet": "EPERM",
        "clone3": "ENOSYS",  # so that the C library falls back to clone, whose flags seccomp can read
        "fork": "allowed",
    }


@needs_linux_seccomp
def test_under_runtime_default_seccomp_the_sandbox_falls_back_and_contains_every_case(seccomp_report):
    assert namespaced_runs(seccomp_report) == {False}  # unshare refused: the fallback, not a setup error
    assert_contained(seccomp_report)


@needs_linux_seccomp
@needs_root
def test_in_a_pod_unprivileged_under_runtime_default_seccomp_every_case_is_contained(battery_dir):
    """What a reward pod is: a non-root uid without capabilities, under the RuntimeDefault profile."""
    report = battery(battery_dir, "auto", seccomp="runtime-default", uid=NOBODY)
    assert report["uid"] == NOBODY and report["kernel_answers"]["unshare"] == "EPERM"
    assert namespaced_runs(report) == {False}
    assert_contained(report)


@needs_linux_seccomp
def test_where_namespaces_can_be_made_but_not_set_up_the_sandbox_falls_back(battery_dir):
    """E.g. Ubuntu's AppArmor restriction of unprivileged user namespaces: `unshare` succeeds, setting the
    namespaces up (`mount`) does not. Tried in a child first, that is the fallback, not a failed run."""
    report = battery(battery_dir, "auto", seccomp="mount-refused", uid=None)
    assert report["kernel_answers"]["unshare"] == "allowed"
    assert namespaced_runs(report) == {False}
    assert_contained(report)


# --- as an unprivileged user (tests here run as root) -----------------------------------------------------


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_as_an_unprivileged_user_every_case_is_contained(battery_dir, isolation, record_property):
    report = battery(battery_dir, isolation, seccomp=None, uid=NOBODY)
    assert report["uid"] == NOBODY
    namespaced = namespaced_runs(report)
    record_property("namespaced", sorted(namespaced))
    print(f"unprivileged, isolation={isolation}: namespaces used: {sorted(namespaced)}")
    if isolation == "rlimits":
        assert namespaced == {False}
    else:
        assert len(namespaced) == 1  # the kernel allows unprivileged user namespaces or not, for every run
    assert_contained(report)
