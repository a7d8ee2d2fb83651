"""`make gpu-check`'s preflight turns import results and the wheels' requirements into one line per part that
cannot run, naming the wheel to add or the version the GPU machine lacks; the wheel set never replaces the
machine's own torch/transformers stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from benchmarks.gpu.check import (
    CUDA_TEST_TIMEOUT_S,
    MACHINE_ONLY,
    NEEDS,
    PREFLIGHT,
    PROBE,
    Check,
    host_problems,
    last_json,
    preflight_verdicts,
    pytest_outcomes,
    stack_problems,
)

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
    assert reason.endswith("; and 1 more (check.json: parts.requirements)")
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


# --- the first part stops the check, in one line, on anything the machine lacks (issue 33, items 8 and 9) ---------

X86_WHEELS = [
    "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "pyyaml-6.0-py3-none-any.whl",
]


def test_an_older_python_is_named_with_the_version_to_install():
    assert host_problems((3, 10), "x86_64", []) == [
        "python 3.10: rljob needs python >= 3.11: install python3.11+ (with a CUDA torch)"
    ]


def test_wheels_for_another_python_or_architecture_name_the_make_gpu_wheels_to_run():
    assert host_problems((3, 12), "x86_64", X86_WHEELS) == []
    assert host_problems((3, 11), "x86_64", X86_WHEELS) == [
        "build/gpu-wheels holds wheels for python 3.12, this is python 3.11: run make gpu-wheels GPU_PYTHON=3.11 "
        "and copy build/gpu-wheels here again"
    ]
    assert host_problems((3, 12), "aarch64", X86_WHEELS) == [  # a GH200
        "build/gpu-wheels holds x86_64 wheels, this machine is aarch64: run make gpu-wheels GPU_ARCH=aarch64 "
        "and copy build/gpu-wheels here again"
    ]


def test_a_torch_without_get_total_norm_and_a_transformers_that_drops_max_cache_len_are_named():
    probe = {"torch": "2.5.1+cu124", "get_total_norm": False, "transformers": "4.45.0", "max_cache_len": False}
    assert stack_problems(probe) == [
        "torch 2.5.1+cu124: rljob needs torch >= 2.6 (torch.nn.utils.get_total_norm): install a CUDA torch >= 2.6",
        "transformers 4.45.0 ignores GenerationConfig.max_cache_len (the hf engine's static cache would be made and "
        "compiled again for every call length): install a newer transformers",
    ]
    current = {"torch": "2.11.0+cu130", "get_total_norm": True, "transformers": "5.17.0", "max_cache_len": True}
    assert stack_problems(current) == []
    missing = stack_problems({"torch_error": "ModuleNotFoundError: No module named 'torch'"})[0]
    assert missing.startswith("torch: ModuleNotFoundError: No module named 'torch': ")
    assert missing.endswith("must have a CUDA torch >= 2.6 itself")


def test_the_probe_reports_this_machine_s_torch_and_transformers():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    probe = last_json(done.stdout)
    assert probe is not None and probe["get_total_norm"] and probe["max_cache_len"]
    assert stack_problems(probe) == []


def test_a_machine_lacking_something_stops_the_check_in_its_first_part_with_one_line(tmp_path):
    """`make gpu-check` as it runs, with wheels for another architecture than this machine's."""
    import platform

    other = "aarch64" if platform.machine() == "x86_64" else "x86_64"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = f"tinywheel-1.0-cp312-cp312-manylinux_2_17_{other}.whl"
    with zipfile.ZipFile(wheels / name, "w") as wheel:
        wheel.writestr("tinywheel/__init__.py", "")
    command = [sys.executable, "benchmarks/gpu/check.py", "--out", str(tmp_path / "out"), "--wheels", str(wheels)]
    command += ["--site", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check cannot run here: ") and f"this machine is {platform.machine()}" in last
    assert f"run make gpu-wheels GPU_ARCH={platform.machine()}" in last
    log = (tmp_path / "out" / "check.log").read_text()
    assert "== cuda_tests" not in log and "== cartpole" not in log  # nothing ran after the first part
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert report["passed"] is False and set(report["parts"]) == {"requirements"}
    assert any(f"GPU_ARCH={platform.machine()}" in p for p in report["parts"]["requirements"]["problems"])


def test_a_part_cut_short_at_its_limit_keeps_every_line_and_test_result_it_printed(tmp_path):
    check = Check(tmp_path, env={**os.environ})
    script = "import time\nprint('tests/gpu/test_a.py::test_one PASSED  [ 50%]', flush=True)\ntime.sleep(60)"
    started = time.monotonic()
    ok, output, _ = check.run("cuda_tests", [sys.executable, "-c", script], limit_s=3)
    assert time.monotonic() - started < 30 and not ok
    assert pytest_outcomes(output) == {"tests/gpu/test_a.py::test_one": "passed"}
    log = (tmp_path / "check.log").read_text()
    assert "tests/gpu/test_a.py::test_one PASSED" in log and "over its 3s limit" in log
    check.record("cuda_tests", ok, 3.0, results=pytest_outcomes(output))
    saved = json.loads((tmp_path / "check.json").read_text())  # written as each part ends, not only at the end
    assert saved["parts"]["cuda_tests"]["results"] == {"tests/gpu/test_a.py::test_one": "passed"}


def test_every_cuda_test_runs_under_its_own_limit_well_under_the_part_s():
    source = (REPO / "benchmarks" / "gpu" / "check.py").read_text()
    assert 'f"--timeout={CUDA_TEST_TIMEOUT_S}"' in source
    assert CUDA_TEST_TIMEOUT_S * 2 <= 240
    assert "pytest_timeout" in NEEDS["cuda_tests"]
