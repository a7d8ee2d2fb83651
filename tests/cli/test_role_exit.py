"""A role process ends without the interpreter's teardown, and loses none of its output or its exit code."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, logging, sys
from rljob.cli.role import exit_without_teardown
logging.basicConfig(stream=sys.stderr, format="%(message)s")
atexit.register(lambda: print("teardown ran", flush=True))
logging.getLogger("rljob.actor").warning("reached trainer.steps")
sys.stdout.write("last line, unflushed")
exit_without_teardown(3)
"""


def test_a_role_process_exits_with_its_code_and_its_output_flushed_but_no_teardown():
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert result.stderr.strip() == "reached trainer.steps"
    assert result.stdout == "last line, unflushed"  # no "teardown ran": atexit and module unloading skipped
