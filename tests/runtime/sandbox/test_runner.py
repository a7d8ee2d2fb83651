"""The sandbox behind code_exec: untrusted code is contained, scores 0 with a counted, named error, the scorer
keeps serving, and nothing of the run is left running. Each containment runs with namespaces (where this
machine allows them) and with the rlimits-only fallback a platform without namespaces gets."""

from __future__ import annotations

import os
import socket

import psutil
import pytest

from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.rewards import RewardInput, RewardScorer, extract_code
from rljob.runtime.sandbox.child import SANDBOX_UID_BASE
from rljob.runtime.sandbox.runner import Sandbox, SandboxLimits, UnrunnableTestsError, parse_tests

# These look at the whole machine (every process under a sandbox uid, the shared TMPDIR): `make test` runs
# them alone, after the parallel part of the suite.
pytestmark = pytest.mark.serial

GOOD = "def f():\n    return 3\n"


def sample(code: str, tests: object = "assert f() == 3") -> RewardInput:
    return {
        "prompt": "write f",
        "response": f"```python\n{code}\n```",
        "row": {"prompt": "write f", "answer": "", "tests": tests},
        "finish_reason": "stop",
        "response_tokens": 10,
    }


def leftovers() -> list[psutil.Process]:
    """Processes of any sandbox run still alive (zombies are dead, awaiting their reaper): below this test
    process, or under a run's own uid."""
    found = [p for p in psutil.Process().children(recursive=True) if p.pid not in _BEFORE]
    found += [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real >= SANDBOX_UID_BASE]
    alive = []
    for process in found:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


READ_EVERY_ENVIRONMENT = """\
import os
seen = repr(dict(os.environ))
for pid in os.listdir('/proc'):
    try:
        seen += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')
    except OSError:
        pass
"""
"""Code that gathers its own environment and every environment /proc lets it read into `seen`."""


@pytest.fixture(params=["auto", "rlimits"])
def scorer(request):
    spec = RewardSpec.model_validate(
        {
            "functions": [{"builtin": "code_exec", "args": {"tests": "tests"}}],
            "sandbox": {"timeoutSeconds": 1, "memoryMb": 256, "maxConcurrency": 2},
        }
    )
    made = RewardScorer(spec, isolation=request.param)
    yield made
    made.close()


@pytest.fixture(autouse=True)
def _processes_before():
    """Processes below this test process that an earlier test left: not this test's sandbox runs."""
    global _BEFORE
    _BEFORE = {p.pid for p in psutil.Process().children(recursive=True)}
    yield


_BEFORE: set[int] = set()


def contained(scorer: RewardScorer, code: str, *named: str) -> None:
    """The bad code scores 0 with one error carrying one of `named`; the good code beside it scores 1; nothing
    lingers."""
    scored = scorer.score([sample(code), sample(GOOD)])
    assert scored.terms["code_exec"] == [0.0, 1.0]
    assert scored.errors == {"code_exec": 1}
    assert any(name in scored.error_messages["code_exec"] for name in named), scored.error_messages
    assert leftovers() == []
    assert scorer.score([sample(GOOD)]).rewards == [1.0]  # and it keeps serving


def test_an_infinite_loop_is_killed_at_its_cpu_or_wall_clock_limit(scorer):
    # Which limit comes first depends on how much CPU the run gets: alone, the CPU-time limit; on a busy
    # machine, the wall clock. Either contains it.
    contained(scorer, "while True:\n    pass", "killed after the wall-clock limit", "CPU time limit")


def test_a_process_that_ignores_sigterm_and_escapes_its_session_is_still_killed(scorer):
    code = """\
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()  # out of the run's process group
    while True:
        time.sleep(1)
while True:
    time.sleep(1)
"""
    contained(scorer, code, "killed after the wall-clock limit")


def test_a_fork_bomb_hits_the_process_limit(scorer):
    contained(scorer, "import os\nwhile True:\n    os.fork()", "process limit reached")


def test_a_memory_bomb_hits_the_memory_limit(scorer):
    contained(scorer, "hoard = []\nwhile True:\n    hoard.append(bytearray(50 * 1024 * 1024))", "out of memory")


def test_a_network_connection_is_refused_even_to_this_machine(scorer):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        contained(scorer, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", "network")


def test_writing_outside_the_working_directory_is_refused(scorer, tmp_path):
    target = tmp_path / "escaped.txt"
    contained(scorer, f"open({str(target)!r}, 'w').write('out')", "write outside the working directory refused")
    assert not target.exists()


def test_the_reward_process_environment_is_invisible(scorer, monkeypatch):
    monkeypatch.setenv("RLJOB_TEST_SECRET", "hunter2-in-the-reward-role")
    code = READ_EVERY_ENVIRONMENT
    # Nothing is refused here, so nothing is counted: the secret is simply not there to find.
    scored = scorer.score([sample(code, "assert 'hunter2-in-the-reward-role' in seen"), sample(GOOD)])
    assert scored.terms["code_exec"] == [0.0, 1.0]
    code_checks = sample(code, "assert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'TMPDIR']")
    assert scorer.score([code_checks]).terms["code_exec"] == [1.0]
    assert leftovers() == []


def test_the_working_directory_is_private_writable_and_removed_afterwards(scorer):
    code = "import os\nopen('notes.txt', 'w').write('kept')\nwhere = os.getcwd()\n"
    sandbox = Sandbox(SandboxLimits(timeout_seconds=5, memory_mb=256), isolation=scorer_isolation(scorer))
    run = sandbox.run(code, parse_tests("assert open('notes.txt').read() == 'kept'\nassert where.endswith('/work')"))
    assert (run.passed, run.total, run.error) == (2, 2, None)
    assert not any(name.startswith("rljob-sandbox-") for name in os.listdir(os.environ.get("TMPDIR", "/tmp")))


def scorer_isolation(scorer: RewardScorer) -> str:
    return "auto" if scorer._terms[0].function.sandbox.isolation == "auto" else "rlimits"


# --- what code_exec runs ---------------------------------------------------------------------------


def test_code_exec_scores_the_fraction_of_tests_that_pass(scorer):
    tests = ["assert f() == 3", "assert f() > 5", "assert isinstance(f(), int)"]
    assert scorer.score([sample(GOOD, tests)]).terms["code_exec"] == [pytest.approx(2 / 3)]


def test_code_exec_runs_stdin_stdout_programs_once_per_pair(scorer):
    program = "n = int(input())\nprint(n * 2)"
    cases = [{"input": "3", "output": "6"}, {"input": "5", "output": "10\n"}, {"input": "1", "output": "3"}]
    scored = scorer.score([sample(program, cases)])
    assert scored.terms["code_exec"] == [pytest.approx(2 / 3)] and scored.errors == {"code_exec": 0}


def test_wrong_or_crashing_code_scores_zero_without_an_error(scorer):
    scored = scorer.score([sample("def f(:"), sample("raise ValueError('no')"), sample("def f():\n    return 4")])
    assert scored.terms["code_exec"] == [0.0, 0.0, 0.0] and scored.errors == {"code_exec": 0}


def test_code_is_the_last_fenced_block_else_the_whole_response():
    assert extract_code("plan\n```python\na = 1\n```\nthen\n```\nb = 2\n```\n") == "b = 2\n"
    assert extract_code("```py\nc = 3\n") == "c = 3\n"  # cut at the length limit before the closing fence
    assert extract_code("x = 7") == "x = 7"


def test_tests_come_as_asserts_or_input_output_pairs():
    assert parse_tests("import math\nassert f() == 1\nassert f() > 0") == {
        "kind": "asserts",
        "setup": ["import math"],
        "asserts": ["assert f() == 1", "assert f() > 0"],
    }
    assert parse_tests('[{"input": "1", "output": "2"}]') == {"kind": "io", "cases": [{"input": "1", "output": "2"}]}
    for bad, message in (("x = 1", "no assert"), ("assert (", "not valid Python"), (3, "got int")):
        with pytest.raises(UnrunnableTestsError, match=message):
            parse_tests(bad)
