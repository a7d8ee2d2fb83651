"""User reward modules run in sandboxed workers under spec.reward.sandbox: a function that misbehaves scores 0
with a counted, named error, the scorer keeps serving, and nothing of the killed worker is left running. Each
containment runs with namespaces (where this machine allows them) and with the rlimits-only fallback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.rewards import RewardConfigError, RewardInput, RewardScorer
from rljob.runtime.sandbox.child import SANDBOX_UID_BASE
from tests.runtime.sandbox.test_runner import READ_EVERY_ENVIRONMENT

# These look at the whole machine (every process under a sandbox uid, the shared TMPDIR): `make test` runs
# them alone, after the parallel part of the suite.
pytestmark = pytest.mark.serial

SECRET = "hunter2-in-the-reward-role"


def sample(response: str) -> RewardInput:
    return {
        "prompt": "p",
        "response": response,
        "row": {"answer": "x"},
        "finish_reason": "stop",
        "response_tokens": 4,
    }


def module(misbehaviour: str) -> str:
    """A reward module whose `bad` scores len(response), except on the response "bad", where it misbehaves."""
    return (
        "import os, signal, socket, sys, time\n\n"
        "def bad(prompt, response, row):\n"
        '    if response == "bad":\n'
        f"{textwrap.indent(textwrap.dedent(misbehaviour), ' ' * 8)}\n"
        "    return float(len(response))\n"
    )


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _processes_before():
    """Processes below this test process that an earlier test left: not this test's workers."""
    global _BEFORE
    _BEFORE = {p.pid for p in psutil.Process().children(recursive=True)}


def module_worker_escapee(process: psutil.Process) -> bool:
    """A process under a sandbox's own uid in a module worker's directory, wherever it was reparented (other
    work on this machine may run code_exec sandboxes, whose directories are named rljob-sandbox-)."""
    try:
        uids = process.uids()
        return uids.real >= SANDBOX_UID_BASE and "/rljob-module-" in process.cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def sandbox_processes() -> list[psutil.Process]:
    """Live processes of any module worker (zombies are dead, awaiting their reaper): below this test process,
    or under a sandbox's own uid in a worker's directory."""
    found = [p for p in psutil.Process().children(recursive=True) if p.pid not in _BEFORE]
    found += [p for p in psutil.process_iter() if module_worker_escapee(p)]
    alive = {}
    for process in found:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive[process.pid] = process
        except psutil.NoSuchProcess:
            continue
    return list(alive.values())


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def strays(scorer: RewardScorer) -> list[psutil.Process]:
    """Sandbox processes other than the live workers' supervisors and their runners (a worker is two)."""
    allowed: set[int] = set()
    for supervisor in scorer._modules[0].worker_pids():
        allowed.add(supervisor)
        try:
            allowed.update(child.pid for child in psutil.Process(supervisor).children())
        except psutil.NoSuchProcess:
            continue
    return [p for p in sandbox_processes() if p.pid not in allowed]


@pytest.fixture(params=["auto", "rlimits"])
def make_scorer(request, tmp_path):
    tmp_path.chmod(0o755)  # run as root, the worker's own uid must enter it (the 0700 ones above may stay)
    made: list[RewardScorer] = []

    def make(misbehaviour: str, **sandbox) -> RewardScorer:
        (tmp_path / "rewards.py").write_text(module(misbehaviour))
        spec = RewardSpec.model_validate(
            {
                "functions": [{"module": "rewards.py:bad"}],
                "sandbox": {"timeoutSeconds": 1, "memoryMb": 256, "maxConcurrency": 2, **sandbox},
            }
        )
        made.append(RewardScorer(spec, base_dir=tmp_path, isolation=request.param))
        return made[-1]

    yield make
    for scorer in made:
        scorer.close()
    assert sandbox_processes() == []  # closing the scorer stops every worker


def contained(scorer: RewardScorer, *named: str) -> None:
    """The misbehaving sample scores 0 with one error naming one of `named`; a normal sample beside it scores;
    nothing of the killed worker lingers; the scorer keeps serving."""
    scored = scorer.score([sample("bad"), sample("good")])
    assert scored.terms == {"bad": [0.0, 4.0]}
    assert scored.errors == {"bad": 1}
    assert any(name in scored.error_messages["bad"] for name in named), scored.error_messages
    assert strays(scorer) == []
    again = scorer.score([sample("good"), sample("fine")])
    assert again.terms == {"bad": [4.0, 4.0]} and again.errors == {"bad": 0}


def test_an_infinite_loop_is_killed_at_the_wall_clock(make_scorer):
    contained(make_scorer("while True:\n    pass"), "killed after the wall-clock limit")


def test_a_memory_bomb_hits_the_memory_limit(make_scorer):
    contained(make_scorer("hoard = []\nwhile True:\n    hoard.append(bytearray(50 * 1024 * 1024))"), "out of memory")


def test_a_fork_bomb_hits_the_process_limit(make_scorer):
    contained(make_scorer("while True:\n    os.fork()"), "process limit reached")


def test_a_network_connection_is_refused_even_to_this_machine(make_scorer):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        scorer = make_scorer(f"socket.create_connection(('127.0.0.1', {port}), timeout=1)")
        contained(scorer, "network access refused")


def test_the_network_is_reachable_when_the_sandbox_allows_it(make_scorer):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        scorer = make_scorer(f"socket.create_connection(('127.0.0.1', {port}), timeout=5).close()", network=True)
        assert scorer.score([sample("bad")]).terms == {"bad": [3.0]}


def test_writing_outside_the_working_directory_is_refused(make_scorer, tmp_path):
    target = tmp_path / "escaped.txt"
    contained(make_scorer(f"open({str(target)!r}, 'w').write('out')"), "write outside the working directory refused")
    assert not target.exists()


def test_a_refused_write_counts_even_when_the_function_catches_it(make_scorer, tmp_path):
    target = tmp_path / "escaped.txt"
    scorer = make_scorer(f"try:\n    open({str(target)!r}, 'w')\nexcept PermissionError:\n    return 1.0")
    contained(scorer, "write outside the working directory refused")


def test_the_reward_process_environment_is_invisible(make_scorer, monkeypatch):
    monkeypatch.setenv("RLJOB_TEST_SECRET", SECRET)
    scorer = make_scorer(f"""\
{READ_EVERY_ENVIRONMENT}
if {SECRET!r} in seen:
    return 100.0
return float(os.environ['RLJOB_TEST_SECRET'] == {SECRET!r})
""")
    contained(scorer, "KeyError: 'RLJOB_TEST_SECRET'")


def test_a_function_that_ignores_sigterm_and_escapes_its_session_is_still_killed(make_scorer):
    scorer = make_scorer("""\
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()  # out of the worker's process group
while True:
    time.sleep(1)
""")
    contained(scorer, "killed after the wall-clock limit")


def test_a_worker_that_exits_costs_only_its_sample(make_scorer):
    contained(make_scorer("os._exit(3)"), "the sandboxed worker died (exit code 3)")


def test_the_function_runs_as_its_own_uid_in_a_private_working_directory(make_scorer):
    scorer = make_scorer("open('notes.txt', 'w').write('kept')\nreturn float(os.getcwd().endswith('/work'))")
    assert scorer.score([sample("bad")]).terms == {"bad": [1.0]}
    if os.geteuid() == 0:
        worker = scorer._modules[0]._idle[0]
        assert worker.uid == SANDBOX_UID_BASE + worker.pid


SCORER_THAT_GETS_KILLED = """\
import sys
from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.rewards import RewardScorer

spec = RewardSpec.model_validate(
    {"functions": [{"module": sys.argv[1]}], "sandbox": {"timeoutSeconds": 600, "maxConcurrency": 1}}
)
scorer = RewardScorer(spec, isolation=sys.argv[2])
print(scorer._modules[0].worker_pids()[0], flush=True)
sample = {"prompt": "p", "response": "bad", "row": {}, "finish_reason": "stop", "response_tokens": 1}
scorer.score([sample])
"""


@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_workers_die_with_a_reward_role_killed_mid_call(tmp_path, isolation):
    tmp_path.chmod(0o755)
    (tmp_path / "rewards.py").write_text(module("print('looping', file=sys.stderr, flush=True)\nwhile True:\n    pass"))
    role = subprocess.Popen(
        [sys.executable, "-c", SCORER_THAT_GETS_KILLED, f"{tmp_path / 'rewards.py'}:bad", isolation],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        supervisor = psutil.Process(int(role.stdout.readline()))
        worker = [supervisor, *supervisor.children(recursive=True)]
        assert role.stderr.readline().strip() == "looping"  # the worker is inside the call
    finally:
        role.kill()
        role.wait()
    # The worker's supervisor sees its lifeline close and kills the call; it is not this test's child.
    deadline = time.monotonic() + 30  # a bound, not a timing: the kill comes as soon as the lifeline closes
    while any(alive(process) for process in worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [process for process in worker if alive(process)] == []
    role.stderr.close()
    role.stdout.close()


# --- what the worker can import ------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_the_module_imports_installed_packages_and_its_siblings(tmp_path, monkeypatch, isolation):
    tmp_path.chmod(0o755)
    (tmp_path / "helpers.py").write_text(
        "import numpy\n\ndef norm(values):\n    return float(numpy.linalg.norm(values))\n"
    )
    (tmp_path / "rewards.py").write_text(
        "import helpers\n\ndef size(prompt, response, row):\n    return helpers.norm([3, len(response)])\n"
    )
    spec = RewardSpec.model_validate({"functions": [{"module": "rewards.py:size"}]})
    # The worker imports from the reward role's own sys.path (the role's working directory is on it).
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer(spec, base_dir=tmp_path, isolation=isolation)
    try:
        assert scorer.score([sample("four")]).terms == {"size": [5.0]}
    finally:
        scorer.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only a reward role run as root hands the module to another uid")
def test_a_module_its_sandbox_uid_cannot_read_is_refused_before_start_naming_the_field(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "rewards.py").write_text("def score(prompt, response, row):\n    return 1.0\n")
    spec = RewardSpec.model_validate(
        {"functions": [{"builtin": "exact_match"}, {"module": "private/rewards.py:score"}]}
    )
    with pytest.raises(RewardConfigError) as caught:
        RewardScorer(spec, base_dir=tmp_path)
    assert str(caught.value).startswith("spec.reward.functions[1].module: the reward sandbox imports ")
    assert f"chmod o+rx {private}" in str(caught.value)


def test_a_file_on_the_import_path_never_shadows_a_module_the_worker_imports_as_root(tmp_path, monkeypatch):
    tmp_path.chmod(0o755)
    marker = tmp_path / "imported-as"
    (tmp_path / "random.py").write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.geteuid()))\n")
    (tmp_path / "rewards.py").write_text(
        "import random\n\ndef where(prompt, response, row):\n    return float(random.__file__.endswith('/random.py')"
        f" and not random.__file__.startswith({str(tmp_path)!r}))\n"
    )
    spec = RewardSpec.model_validate({"functions": [{"module": "rewards.py:where"}]})
    monkeypatch.syspath_prepend(str(tmp_path))  # as the reward role's working directory is
    scorer = RewardScorer(spec, base_dir=tmp_path)
    try:
        assert scorer.score([sample("x")]).terms == {"where": [1.0]}
    finally:
        scorer.close()
    assert not marker.exists()
