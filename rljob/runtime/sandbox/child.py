"""The program a sandboxed run executes: it confines itself, then runs the untrusted code and reports.

Standard library only, and run as `python -I -S -c <this file's source>` in a fresh process that the parent
(`rljob.runtime.sandbox.runner`) started in its own session with a minimal environment, so nothing is done between
fork and exec in the reward process (whose threads may hold locks). The request arrives as JSON on stdin.

This process (the supervisor) confines what it can, forks the runner and waits for it:

1. Namespaces, where the kernel allows them: a mount namespace in which every mount but the private working
   directory is read-only, a pid namespace whose init is the runner (when it dies the kernel kills all that
   is left in it), and a network namespace with only a loopback that is down (unless `network`). As root this
   needs no user namespace; otherwise a user namespace maps the caller's own uid.
2. The runner (pid 1 of the new pid namespace) mounts a fresh /proc (host processes, and their environments,
   are invisible), drops to an unprivileged uid of its own when started as root, sets rlimits (address space,
   CPU seconds, processes, file size, core dumps), forbids new privileges, drops every capability, installs
   an audit hook that refuses sockets (unless `network`) and writes outside the working directory, and only
   then runs the untrusted code.
3. Without namespaces (seccomp or the kernel refuse them, or refuse setting them up: tried in a child
   first) the rlimits and the audit hook still apply, the supervisor becomes a child subreaper so that
   escaped descendants stay in its tree, and it kills whatever is left before it exits.

The result is one line `<token> <json>` written to a descriptor the runner opened before the untrusted code
ran; the parent ignores lines without its per-run token.

The same program confines a worker for a user's reward module (`"kind": "module"`, started by
`rljob.runtime.sandbox.confined_module` as `python -I -c`, with site-packages): the runner imports the module after
confining itself and then scores samples one request at a time (`serve_module`) until the scorer stops it.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SANDBOX_UID_BASE = 1_500_000_000
"""Run as root, the runner becomes uid BASE + the supervisor's pid: a uid nothing else uses, so the process
limit (RLIMIT_NPROC counts every process of a uid) counts this run's processes alone."""

_libc = ctypes.CDLL(None, use_errno=True)
_MOUNT_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags):
    _check(
        _libc.mount(
            source.encode() if source else None, target.encode(), fstype.encode() if fstype else None, flags, None
        ),
        f"mount {target}",
    )


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _mountpoints():
    """(mount point, flags to keep) of every mount, parents first."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for option in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(option, 0)
            found.append((point, flags))
    return found


def enter_namespaces(request):
    """Private mount, pid and (unless network) network namespaces; False when the kernel refuses them."""
    flags = CLONE_NEWNS | CLONE_NEWPID | (0 if request["network"] else CLONE_NEWNET)
    uid, gid = os.geteuid(), os.getegid()
    if uid != 0:
        flags |= CLONE_NEWUSER
    if _libc.unshare(flags) != 0:
        return False
    if uid != 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    workdir = request["workdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    _mount(workdir, workdir, None, MS_BIND)  # its own mount, so that it stays writable below
    if uid == 0 and not _reachable_by_others(sys.base_prefix):
        # The runner drops to a uid of its own; an interpreter under e.g. /root (0700) would be unreadable to
        # it: show the installation (read-only, like everything) where that uid can reach it.
        alias = os.path.join(os.path.dirname(workdir), "python")
        os.makedirs(alias, exist_ok=True)  # made already when `namespaces_usable` tried this in a child
        _mount(sys.base_prefix, alias, None, MS_BIND | MS_REC)
        request["stdlib_alias"] = alias
    for point, keep in _mountpoints():
        if point == workdir or keep & MS_RDONLY:
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            # A mount this user may not remount (e.g. under /proc or /sys): harmless ones only, or
            # the host's / itself, which is checked below.
            if point == "/":
                raise
    return True


def namespaces_usable(request):
    """Whether `enter_namespaces` works here, tried in a child first: once `unshare` succeeds this process
    cannot leave the namespaces, and some platforms allow `unshare` but refuse setting them up (AppArmor's
    restriction of unprivileged user namespaces leaves the new one without capabilities; a seccomp profile
    may refuse `mount` alone). Found out here, such a platform gets the fallback, not a failed run."""
    child = os.fork()
    if child == 0:
        try:
            usable = enter_namespaces(dict(request))
        except OSError:
            usable = False
        os._exit(0 if usable else 1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _reachable_by_others(path):
    parts = os.path.realpath(path).split(os.sep)
    return all(os.stat(os.sep.join(parts[:depth]) or os.sep).st_mode & 1 for depth in range(2, len(parts) + 1))


PRELOADED = [
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "functools",
    "heapq",
    "io",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
    "fractions",
    "decimal",
    "socket",
    "encodings.idna",
]
"""Imported before the runner drops to its own uid: with no namespaces to show it the interpreter's files, a
run started as root could import nothing else from an installation other users cannot read."""


def move_import_paths(mapping):
    """Imports from each directory of `mapping` come from the path it maps to (the longest match wins), for
    `sys.path` and the packages imported so far (so that they find their submodules there too)."""
    prefixes = sorted(mapping, key=len, reverse=True)

    def moved(path):
        for prefix in prefixes:
            if path == prefix or path.startswith(prefix.rstrip(os.sep) + os.sep):
                return mapping[prefix] + path[len(prefix) :]
        return path

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):
        if isinstance(getattr(module, "__path__", None), list):
            module.__path__[:] = [moved(p) for p in module.__path__]
    return moved


def hold_open_directories(paths):
    """As root, before dropping to the run's own uid: each directory of `paths` that uid could not reach (e.g.
    below /root, 0700) is opened here and named `/proc/self/fd/N` from then on. A process may always follow its
    own descriptors, and a lookup through one skips the directories above it that this uid cannot enter, so the
    run reads what it must import (the interpreter, site-packages, the user's module) without running the
    user's code as root. What else becomes reachable is what other users could read between the held directory
    and the closed one above it (`..` works): never the closed directory's other contents. Returns
    {path: alias}."""
    if os.geteuid() != 0:
        return {}
    held = {}
    for path in paths:
        if path and os.path.isdir(path) and not _reachable_by_others(path):
            held[path] = f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}"
    return held


def count_own_tasks():
    """Threads of every process of this real uid (what RLIMIT_NPROC counts)."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass  # gone meanwhile
    return count


def confine(request, namespaced, supervisor_pid):
    """In the runner: the limits that apply with or without namespaces. Returns the uid it runs as."""
    limits = request["limits"]
    if namespaced:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PRELOADED:
        __import__(name)
    alias = request.get("stdlib_alias")
    if alias:
        move_import_paths({sys.base_prefix: alias})
    if os.geteuid() == 0:
        uid = SANDBOX_UID_BASE + supervisor_pid
        os.chown(request["workdir"], uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        processes = limits["processes"]
    elif namespaced:
        processes = limits["processes"]  # counted per user namespace: this run's processes alone
    else:
        processes = count_own_tasks() + limits["processes"]  # shared with the reward role's uid: see docs
    memory = limits["memory_mb"] * 1024 * 1024
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if cpu is not None:  # None for a long-lived module worker: CPU time adds up over its samples
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _drop_capabilities()
    return os.getuid()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    """A process in a user namespace it created holds every capability there until it execs: give them up."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


# --- the untrusted code --------------------------------------------------------------------------


def install_guard(request, violations, spawned):
    """An audit hook: refuses sockets (unless network) and writes outside the working directory, noting each."""
    workdir = os.path.realpath(request["workdir"])
    network = request["network"]
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.rename",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
    }
    net_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    inside_check = os.path.realpath
    refuse = PermissionError

    def outside(path):
        if isinstance(path, int):
            return False
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        resolved = inside_check(str(path))
        return resolved != "/dev/null" and resolved != workdir and not resolved.startswith(workdir + os.sep)

    def note(message):
        if len(violations) < 8:
            violations.append(message)
        raise refuse(f"rljob sandbox: {message}")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (flags & write_flags) if isinstance(flags, int) and flags >= 0 else False
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                writing = True
            if writing and outside(path):
                note(f"write outside the working directory refused ({path})")
        elif event in path_events:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and outside(path):
                    note(f"{event} outside the working directory refused ({path})")
        elif event in SPAWN_EVENTS:
            spawned.append(event)
        elif event in net_events and not network:
            family = getattr(args[0], "family", None)
            if family is not None and family != getattr(__import__("socket"), "AF_UNIX", -1):
                note(f"network access refused ({event} {args[1]!r}; spec.reward.sandbox.network is false)")

    sys.addaudithook(hook)


LIMIT_ERRORS = (MemoryError, BlockingIOError)
"""What the rlimits make the code raise (out of address space; fork refused at the process limit): they end the
run as a counted sandbox error, not as the code's own wrong answer."""
SPAWN_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.exec"}


def _same_output(got, expected, compare="lines"):
    """Lines without trailing whitespace; with compare "whitespace" (benchmark stdio sets, as their own judges)
    any run of whitespace is one separator."""
    if compare == "whitespace":
        return str(got).split() == str(expected).split()

    def lines(text):
        return [line.rstrip() for line in str(text).strip().splitlines()]

    return lines(got) == lines(expected)


def run_tests(request, violations):
    """(passed, total, crash) of the code against its tests; runs in this process, after `install_guard`."""
    import builtins
    import io

    code, tests = request["code"], request["tests"]
    try:
        program = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        total = len(tests["asserts"]) if tests["kind"] == "asserts" else len(tests["cases"])
        return 0, total, f"SyntaxError: {exc}"
    crash = None
    passed = 0
    if tests["kind"] == "asserts":
        scope = {"__name__": "solution", "__builtins__": builtins}
        try:
            exec(program, scope)
            for setup in tests["setup"]:
                exec(compile(setup, "tests.py", "exec"), scope)
        except LIMIT_ERRORS:
            raise
        except BaseException as exc:  # the code's own failure: every test fails
            return 0, len(tests["asserts"]), f"{type(exc).__name__}: {exc}"
        for check in tests["asserts"]:
            try:
                exec(compile(check, "tests.py", "exec"), scope)
            except LIMIT_ERRORS:
                raise
            except BaseException as exc:
                crash = crash or f"{type(exc).__name__}: {exc}"
            else:
                passed += 1
        return passed, len(tests["asserts"]), crash
    for case in tests["cases"]:
        stdin, stdout = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = io.StringIO(str(case["input"])), io.StringIO()
        try:
            try:
                exec(program, {"__name__": "__main__", "__builtins__": builtins})
                ok = True
            except SystemExit as exc:
                ok = exc.code in (None, 0)
            output = sys.stdout.getvalue()
        except LIMIT_ERRORS:
            raise
        except BaseException as exc:
            ok, output = False, ""
            crash = crash or f"{type(exc).__name__}: {exc}"
        finally:
            sys.stdin, sys.stdout = stdin, stdout
        if ok and _same_output(output, case["output"], tests.get("compare", "lines")):
            passed += 1
    return passed, len(tests["cases"]), crash


def runner(request, namespaced, supervisor_pid, result_fd, request_fd):
    """Pid 1 of the sandbox (when namespaced): confine, run, report. Never returns."""
    pid = os.getpid()
    report = {"namespaced": namespaced, "violations": []}
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if request["kind"] == "module":
            # The scorer's import path first (its PYTHONPATH and working directory included), then what `site`
            # added here (e.g. the finders of editable installs). It takes effect only once the runner is
            # confined: a file in the scorer's working directory must not shadow a module imported as root.
            import_path = request["sys_path"] + [p for p in sys.path if p not in request["sys_path"]]
            held = hold_open_directories([*import_path, os.path.dirname(request["ref"].rpartition(":")[0])])
            moved = move_import_paths(held)
            request["ref"], request["import_path"] = moved(request["ref"]), [moved(p) for p in import_path]
        report["uid"] = confine(request, namespaced, supervisor_pid)
        os.chdir(request["workdir"])
        sys.dont_write_bytecode = True
        spawned = []
        install_guard(request, report["violations"], spawned)
        if request["kind"] == "module":
            serve_module(request, report, spawned, request_fd, result_fd)  # never returns
        try:
            passed, total, crash = run_tests(request, report["violations"])
            report.update(passed=passed, total=total, crash=crash)
        except MemoryError:
            report["violations"].append(_out_of_memory(request))
        except BlockingIOError as exc:
            if spawned:
                report["violations"].append(_process_limit(request, exc))
            else:  # a non-blocking call of the code's own: its failure, not the sandbox's
                report.update(passed=0, total=1, crash=f"BlockingIOError: {exc}")
    except BaseException as exc:
        if os.getpid() == pid:
            report["setup_error"] = f"{type(exc).__name__}: {exc}"
    if os.getpid() != pid:
        os._exit(0)  # a process the code forked came back out of it: only the runner reports
    _reply(request, result_fd, report)
    os._exit(0)


def _out_of_memory(request):
    return f"out of memory (spec.reward.sandbox.memoryMb: {request['limits']['memory_mb']})"


def _process_limit(request, exc):
    return f"process limit reached ({request['limits']['processes']} processes per run): {exc}"


def _reply(request, result_fd, report):
    line = f"{request['token']} {json.dumps(report)}\n".encode()
    while line:
        line = line[os.write(result_fd, line) :]


# --- a user's reward module ----------------------------------------------------------------------


def serve_module(request, report, spawned, request_fd, result_fd):
    """The runner of a module worker: imports the user's reward function once (confined already), then scores
    one sample per request until the scorer closes the pipe. A request is an 8-byte length and a pickle of
    {prompt, response, row, kwargs} (from the scorer: trusted); a reply is a JSON line `{"value": float}` or
    `{"error": str}`, plus `"recycle": true` when this process must not serve again (a limit was hit, a rule
    broken, a process started: what is left of it dies with the worker). Never returns."""
    import numbers
    import pickle

    pid = os.getpid()
    violations = report["violations"]
    sys.path[:] = request["import_path"]
    try:
        from rljob.runtime.sandbox.user_code import describe_exception, load_user_module

        module, _, name = load_user_module(request["ref"], None, ValueError, "rewards.py", "reward")
        function = getattr(module, name)
    except BaseException as exc:  # the user's import-time failure, or a file this uid cannot read
        if os.getpid() != pid:
            os._exit(0)
        report["load_error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
        _reply(request, result_fd, report)
        os._exit(0)
    report["ready"] = True
    _reply(request, result_fd, report)
    requests = os.fdopen(request_fd, "rb")
    while True:
        header = requests.read(8)
        if len(header) < 8:
            os._exit(0)  # the scorer closed the pipe: it stops this worker or is gone
        sample = pickle.loads(requests.read(int.from_bytes(header, "big")))
        del violations[:], spawned[:]
        outcome = {}
        try:
            value = function(sample["prompt"], sample["response"], sample["row"], **sample["kwargs"])
            if isinstance(value, numbers.Real):
                outcome["value"] = float(value)  # the scorer refuses what is not finite
            else:
                outcome["error"] = f"returned {value!r:.200}, not a finite number"
        except MemoryError:
            outcome.update(error=_out_of_memory(request), recycle=True)
        except BlockingIOError as exc:
            outcome["error"] = _process_limit(request, exc) if spawned else describe_exception(exc)
        except BaseException as exc:  # the function's own failure (SystemExit included): it scores 0
            outcome["error"] = describe_exception(exc)
        if os.getpid() != pid:
            os._exit(0)  # a process the function forked came back out of it: only the runner replies
        if violations:
            outcome = {"error": violations[0], "recycle": True}
        if spawned:
            outcome["recycle"] = True
        _reply(request, result_fd, outcome)


def kill_descendants():
    """SIGKILL every process left below this one (reparented here as a subreaper) until none is."""
    me = str(os.getpid())
    while True:
        children = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                if stat[stat.rfind(")") + 2 :].split()[1] == me:
                    children.append(int(entry))
        if not children:
            return
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)


def wait_for_runner(child, lifeline_fd):
    """The runner's wait status. With a lifeline (a module worker, which outlives any one request), the runner
    is killed as soon as the scorer's end of the lifeline closes: the reward role is gone, e.g. SIGKILLed while
    a call was still running."""
    if lifeline_fd is None:
        return os.waitpid(child, 0)[1]
    import select

    poller = select.poll()
    poller.register(lifeline_fd, select.POLLIN)
    try:
        child_fd = os.pidfd_open(child)
        poller.register(child_fd, select.POLLIN)
        interval = None
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look at the runner every 0.2 s
        interval = 200
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            return status
        if any(fd == lifeline_fd for fd, _ in poller.poll(interval)):
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
            return os.waitpid(child, 0)[1]


def main():
    # One JSON line: a module worker's scorer sends nothing more before the worker says it is ready, so
    # reading it buffered takes nothing that belongs to the runner.
    request = json.loads(sys.stdin.buffer.readline())
    request.setdefault("kind", "code")
    request_fd = os.dup(0) if request["kind"] == "module" else None
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    result_fd = os.dup(1)  # not inheritable across exec; the code's prints go to the log instead
    os.dup2(2, 1)
    supervisor_pid = os.getpid()
    namespaced = False
    if request["isolation"] == "auto" and namespaces_usable(request):
        try:
            namespaced = enter_namespaces(request)
        except OSError as exc:
            # Partly set up (e.g. a mount refused): the namespaces are unusable, and this process is in them.
            sys.stderr.write(f"rljob sandbox: namespaces unusable ({exc})\n")
            os._exit(70)
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    child = os.fork()
    if child == 0:
        runner(request, namespaced, supervisor_pid, result_fd, request_fd)
    os.close(result_fd)
    if request_fd is not None:
        os.close(request_fd)  # the runner's alone: its end of file is the runner's signal to stop
    status = wait_for_runner(child, request.get("lifeline_fd"))
    kill_descendants()
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
