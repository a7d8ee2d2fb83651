"""The sandbox's containment battery as a program, for platforms a test process cannot become itself.

`python -m tests.runtime.sandbox.battery --isolation auto [--seccomp RULES] --tmp DIR` runs each bad program
of tests/runtime/sandbox/test_runner.py once through `rljob.runtime.sandbox.runner.Sandbox` (beside a good one) and
prints one JSON object: per case what the run reported (error, passed/total, namespaced, uid) and which of its
processes were still alive afterwards. With `--seccomp runtime-default` it first confines itself to the
RuntimeDefault profile's namespace rules (tests/runtime/sandbox/runtime_default_seccomp.py) and reports what the
kernel then answers to unshare, clone with a namespace flag, and clone3. The test that starts it (as another uid,
under seccomp) asserts on the report; this program asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

SECRET = "hunter2-in-the-reward-role"
"""Set in this process's environment as it runs (like the other battery): no run may see it."""
LAUNCH_SECRET = "swordfish-in-the-pod-spec"
"""Given in this process's environment at exec by the test (RLJOB_TEST_LAUNCH_SECRET), like a pod's env: it is
also in /proc/<this pid>/environ, which a run under the reward role's own uid could read (docs/sandbox.md)."""
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000

CASES = {
    "infinite_loop": "while True:\n    pass",
    "sigterm_ignoring_escapee": (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    while True:\n"
        "        time.sleep(1)\n"
        "while True:\n"
        "    time.sleep(1)\n"
    ),
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "memory_bomb": "hoard = []\nwhile True:\n    hoard.append(bytearray(50 * 1024 * 1024))",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
    "write_outside": "open({target!r}, 'w').write('out')",
    "secret_env": (
        "import os\n"
        "seen = repr(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        seen += open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        pass\n"
    ),
}
GOOD = "def f():\n    return 3\n"


def probe_namespace_calls() -> dict[str, str]:
    """What the kernel answers (errno name, or "allowed") to the calls the RuntimeDefault profile refuses.

    Each call is made in a child made for it: one that succeeds changes only that child."""
    import errno

    from tests.runtime.sandbox import runtime_default_seccomp as profile

    libc = ctypes.CDLL(None, use_errno=True)
    numbers = profile.syscall_numbers()

    def answer(call) -> str:
        pid = os.fork()
        if pid == 0:
            result = call()
            os._exit(0 if result >= 0 else ctypes.get_errno())
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return "allowed" if code == 0 else errno.errorcode.get(code, f"exit {code}")

    def clone_newnet() -> int:
        # A raw clone with SIGCHLD and no stack behaves like fork: a child that gets through exits at once.
        child = libc.syscall(numbers["clone"], CLONE_NEWNET | signal.SIGCHLD, 0, 0, 0, 0)
        if child == 0:
            os._exit(0)
        if child > 0:
            os.waitpid(child, 0)
        return child

    return {
        "unshare": answer(lambda: libc.syscall(numbers["unshare"], CLONE_NEWUSER)),
        "clone_newnet": answer(clone_newnet),
        "clone3": answer(lambda: libc.syscall(numbers["clone3"], 0, 0)),
        "fork": answer(lambda: 0),  # a plain fork (clone without namespace flags) still works
    }


def leftovers(root: Path) -> list[str]:
    """Processes of a finished run still alive: below this process, or working in a run directory."""
    import psutil

    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != me.pid and process.cwd().startswith(str(root)):
                found[process.pid] = process
    alive = []
    for process in found.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()}")
    return alive


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--isolation", choices=["auto", "rlimits"], required=True)
    parser.add_argument("--seccomp", choices=["runtime-default", "mount-refused"])
    parser.add_argument("--tmp", required=True, help="a directory this uid owns; runs and targets go there")
    args = parser.parse_args()
    report: dict = {"uid": os.getuid()}
    if args.seccomp:
        from tests.runtime.sandbox import runtime_default_seccomp

        runtime_default_seccomp.install(args.seccomp)
        report["kernel_answers"] = probe_namespace_calls()
    root = Path(args.tmp)
    tempfile.tempdir = str(root)  # the runs' working directories: leftovers are found by where they work
    os.environ["RLJOB_TEST_SECRET"] = SECRET
    from rljob.runtime.sandbox.runner import Sandbox, SandboxLimits, parse_tests

    sandbox = Sandbox(SandboxLimits(timeout_seconds=1, memory_mb=256), max_concurrency=2, isolation=args.isolation)
    target = root / "escaped.txt"
    cases = {}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for name, template in CASES.items():
            code = template.format(port=port, target=str(target))
            tests = "assert f() == 3"
            if name == "secret_env":
                tests = [f"assert {SECRET!r} not in seen, 'set'", f"assert {LAUNCH_SECRET!r} not in seen, 'launch'"]
            run = sandbox.run(code, parse_tests(tests))
            good = sandbox.run(GOOD, parse_tests("assert f() == 3"))
            cases[name] = {
                "error": run.error,
                "passed": run.passed,
                "total": run.total,
                "namespaced": run.namespaced,
                "uid": run.uid,
                "good_score": good.score,
                "good_namespaced": good.namespaced,
                "crash": run.crash,
                "leftovers": leftovers(root),
            }
    cases["write_outside"]["target_exists"] = target.exists()
    report["cases"] = cases
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
