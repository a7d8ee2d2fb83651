"""`make gpu-check`'s preflight turns import results and the wheels' requirements into one line per part that
cannot run, naming the wheel to add or the version the GPU machine lacks; the wheel set never replaces the
machine's own torch/transformers stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.check import MACHINE_ONLY, NEEDS, PREFLIGHT, Check, preflight_verdicts

REPO = Path(__file__).resolve().parents[2]
EVERY_MODULE = {m for modules in NEEDS.values() for m in modules}


def requirement(name: str, spec: str, have: str | None, ok: bool = True) -> dict:
    return {"name": name, "spec": spec, "have": have, "ok": ok}


def all_imported() -> dict:
    return dict.fromkeys(EVERY_MODULE)


def wheels(datasets_requires: list[dict] | None = None) -> dict:
    """A slice of the real wheel set: trl reaches datasets, datasets reaches the machine's pyarrow."""
    return {
        "trl": {"version": "1.16.0", "requires": [requirement("datasets", "datasets>=4.7.0", "5.2.0")]},
        "datasets": {
            "version": "5.2.0",
            "requires": datasets_requires or [requirement("pyarrow", "pyarrow>=24.0.0", "26.0.1")],
        },
        "pydantic": {"version": "2.14.4", "requires": [requirement("typing-extensions", "t>=4.16.0", "4.16.0")]},
    }


def test_every_part_runs_when_everything_imports_and_every_requirement_is_met():
    assert preflight_verdicts(all_imported(), wheels()) == dict.fromkeys(NEEDS)


def test_a_missing_role_wheel_stops_every_part_and_names_the_wheel_to_add():
    imports = all_imported() | {"zmq": {"error": "ModuleNotFoundError: No module named 'zmq'", "missing": "zmq"}}
    verdicts = preflight_verdicts(imports, wheels())
    assert set(verdicts) == set(NEEDS)
    for reason in verdicts.values():
        assert reason == "zmq: no module zmq: add pyzmq to constraints/gpu-wheels.txt and rerun make gpu-wheels"


def test_a_module_missing_under_the_trl_side_stops_only_the_benchmark():
    missing = {"error": "ModuleNotFoundError: No module named 'pandas'", "missing": "pandas"}
    verdicts = preflight_verdicts(all_imported() | {"datasets": missing}, wheels())
    assert verdicts.pop("grpo_vs_trl") == (
        "datasets: no module pandas: add pandas to constraints/gpu-wheels.txt and rerun make gpu-wheels"
    )
    assert verdicts == dict.fromkeys(verdicts)


def test_a_machine_package_too_old_for_a_wheel_names_both_versions_and_the_way_out():
    too_old = [requirement("pyarrow", "pyarrow>=24.0.0", "21.0.0", ok=False)]
    verdicts = preflight_verdicts(all_imported(), wheels(datasets_requires=too_old))
    # trl imports, but reaches datasets, whose requirement the machine's pyarrow does not meet.
    assert verdicts["grpo_vs_trl"] == (
        "datasets 5.2.0 needs pyarrow>=24.0.0, found 21.0.0 "
        "(the machine's own: upgrade it there, or pin an older datasets in constraints/gpu-wheels.txt)"
    )
    assert verdicts["cartpole"] is None


def test_a_requirement_nothing_provides_asks_for_that_wheel():
    absent = [requirement("xxhash", "xxhash", None, ok=False)]
    verdicts = preflight_verdicts(all_imported(), wheels(datasets_requires=absent))
    reason = "datasets 5.2.0 needs xxhash, not found (add xxhash to constraints/gpu-wheels.txt)"
    assert verdicts["grpo_vs_trl"] == reason


def test_the_machine_lacking_its_own_torch_is_not_fixed_by_a_wheel():
    imports = all_imported() | {"torch": {"error": "ModuleNotFoundError: No module named 'torch'", "missing": "torch"}}
    for reason in preflight_verdicts(imports, {}).values():
        assert reason == "torch: no module torch: the GPU machine's python must have torch itself"


def test_a_compiled_wheel_for_another_python_reads_as_broken_not_missing():
    broken = {
        "error": "ModuleNotFoundError: No module named 'pydantic_core._pydantic_core'",
        "missing": "pydantic_core._pydantic_core",
    }
    reason = preflight_verdicts(all_imported() | {"pydantic": broken}, {})["cartpole"]
    assert reason.startswith("pydantic: ModuleNotFoundError: No module named 'pydantic_core._pydantic_core'")
    assert "another python than GPU_PYTHON" in reason


def test_the_wheel_set_never_brings_what_the_machines_torch_and_transformers_stand_on():
    lines = (REPO / "constraints" / "gpu-wheels.txt").read_text().splitlines()
    brought = {re.split(r"[=<>!~ ]", line)[0].lower() for line in lines if line.strip() and not line.startswith("#")}
    assert brought and not brought & MACHINE_ONLY
    assert {"pydantic", "pyzmq", "msgspec", "gymnasium", "trl", "datasets", "pandas", "xxhash"} <= brought


def test_the_preflight_probe_reports_a_missing_module_and_an_unmet_requirement_from_a_wheel_site(tmp_path):
    """The probe as it runs on the machine: one child process over a site holding one wheel's metadata."""
    info = tmp_path / "site" / "tinywheel-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tinywheel\nVersion: 1.0\n"
        "Requires-Dist: pytest>=999\nRequires-Dist: pytest\n"
        'Requires-Dist: no-such-dist-rljob; extra == "docs"\nRequires-Dist: no-such-dist-rljob; python_version < "3"\n'
    )
    command = [sys.executable, "-c", PREFLIGHT, str(info.parent), "json", "no_such_module_rljob"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["imports"]["json"] is None
    assert found["imports"]["no_such_module_rljob"]["missing"] == "no_such_module_rljob"
    requires = found["wheels"]["tinywheel"]["requires"]
    # The extra's and the other python's requirements do not apply; the version one fails against what is there.
    assert [(r["spec"], r["ok"]) for r in requires] == [("pytest>=999", False), ("pytest", True)]
    assert requires[0]["have"] == requires[1]["have"] and requires[0]["have"]


def test_a_part_with_many_problems_names_the_first_three_and_counts_the_rest():
    imports = all_imported() | {
        m: {"error": f"ModuleNotFoundError: No module named '{m}'", "missing": m} for m in ("typer", "rich", "zmq")
    }
    absent = [requirement("transformers", "transformers>=4.56.2", None, ok=False)]
    reason = preflight_verdicts(imports, {"trl": {"version": "1.16.0", "requires": absent}})["grpo_vs_trl"]
    assert reason.startswith("typer: no module typer: add typer to constraints/gpu-wheels.txt")
    assert reason.endswith("; and 1 more (check.json: parts.preflight)")
    absent_alone = preflight_verdicts(all_imported(), {"trl": {"version": "1.16.0", "requires": absent}})
    assert absent_alone["grpo_vs_trl"] == (
        "trl 1.16.0 needs transformers>=4.56.2, not found (the GPU machine's python must have it itself)"
    )


def test_a_blocked_part_is_recorded_failed_with_its_reason_and_not_run(tmp_path):
    check = Check(tmp_path, env={})
    check.blocked = {"cartpole": "zmq: no module zmq: add pyzmq", "grpo_tiny": None}
    assert check.runs("grpo_tiny") and "grpo_tiny" not in check.parts
    assert not check.runs("cartpole")
    assert check.parts["cartpole"] == {"ok": False, "seconds": 0.0, "not_run": "zmq: no module zmq: add pyzmq"}
    assert "== cartpole: not run: zmq: no module zmq: add pyzmq" in (tmp_path / "check.log").read_text()


def test_an_unmet_requirement_two_wheels_down_stops_every_part_that_reaches_it():
    core = {
        "version": "2.50.5",
        "requires": [requirement("typing-extensions", "typing-extensions>=4.16.0", "4.12.2", False)],
    }
    pydantic = {"version": "2.14.4", "requires": [requirement("pydantic-core", "pydantic-core==2.50.5", "2.50.5")]}
    verdicts = preflight_verdicts(all_imported(), {"pydantic": pydantic, "pydantic-core": core})
    reason = (
        "pydantic-core 2.50.5 needs typing-extensions>=4.16.0, found 4.12.2 "
        "(pin a matching typing-extensions in constraints/gpu-wheels.txt)"
    )
    assert verdicts == dict.fromkeys(NEEDS, reason)
