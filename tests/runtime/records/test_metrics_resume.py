"""After a resume, metrics.jsonl drops the records of the steps that are redone, and a crash never tears it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rljob.runtime.records.metrics import keep_records_until, read_metrics


def ten_records(path: Path) -> str:
    text = "".join(json.dumps({"step": s, "wall_time": 1.5 * s, "return_mean": 10.0 * s}) + "\n" for s in range(1, 11))
    path.write_text(text)
    return text


def test_records_after_the_resumed_step_are_dropped_and_wall_time_continues(tmp_path):
    path = tmp_path / "metrics.jsonl"
    ten_records(path)
    assert keep_records_until(path, 6) == 9.0
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    assert keep_records_until(tmp_path / "missing.jsonl", 6) == 0.0


def test_a_rewrite_that_fails_midway_leaves_the_old_records(tmp_path):
    """The write runs out of room half way (a file size limit, as a full disk would): nothing is lost."""
    path = tmp_path / "metrics.jsonl"
    before = ten_records(path)
    script = textwrap.dedent(
        """
        import resource, sys
        from rljob.runtime.records.metrics import keep_records_until
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
        keep_records_until(sys.argv[1], 8)
        """
    )
    done = subprocess.run([sys.executable, "-c", script, str(path), str(len(before) // 3)], capture_output=True)
    assert done.returncode != 0 and b"File too large" in done.stderr, done.stderr.decode()
    assert path.read_text() == before
    keep_records_until(path, 8)  # the restarted actor rewrites it, and removes the cut-off copy
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


_KILL_AT_EACH_POINT = textwrap.dedent(
    """
    import json, os, shutil, sys
    from rljob.runtime.records.metrics import keep_records_until
    from tests.crash_points import kill_at_each_point

    source, base = sys.argv[1:3]

    def prepare(n):
        os.makedirs(os.path.join(base, f"kill-{n}"))
        path = os.path.join(base, f"kill-{n}", "metrics.jsonl")
        shutil.copyfile(source, path)
        return path

    print(json.dumps(kill_at_each_point(prepare, lambda path: keep_records_until(path, 4))))
    """
)


def test_a_rewrite_killed_at_any_point_leaves_all_old_or_all_kept_records(tmp_path):
    source = tmp_path / "source.jsonl"
    before = ten_records(source)
    kept = "".join(line + "\n" for line in before.splitlines()[:4])
    done = subprocess.run([sys.executable, "-c", _KILL_AT_EACH_POINT, str(source), str(tmp_path)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    statuses = json.loads(done.stdout)
    assert statuses[-1] == 0 and len(statuses) >= 3 and all(os.WIFSIGNALED(s) for s in statuses[:-1])
    for n in range(1, len(statuses)):
        path = tmp_path / f"kill-{n}" / "metrics.jsonl"
        assert path.read_text() in (before, kept), n
        keep_records_until(path, 4)
        assert path.read_text() == kept
        assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]
