"""docs/troubleshooting.md explains every exit code the code can return and every reason the operator writes."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"

# Where exit codes are decided: the command line, the launchers and the role runtime.
EXIT_CODE_SOURCES = ("rljob/cli", "rljob/launch", "rljob/runtime")
# Where the operator names phases, conditions, reasons and Events.
REASON_SOURCES = ("rljob/operator/reconcile.py", "rljob/operator/status.py", "rljob/operator/podstate.py")
REASON_SOURCES += ("rljob/operator/controller.py",)
REASON_CONSTANTS = {"QuotaExceeded", "LimitRangeExceeded"}
"""Reasons defined in rljob/operator/admission.py (whose other capitalised words are quota scope names)."""
# Capitalised words in those files that are Kubernetes vocabulary, not something the operator reports.
KUBERNETES_WORDS = {
    "ConfigMap", "NetworkPolicy", "PodGroup", "Pod", "Service", "Event", "KopfPeering", "ClusterKopfPeering",
    "True", "False", "Unknown", "Normal", "Warning", "PodScheduled", "Background", "DeleteOptions",
    "ResourceQuota", "LimitRange", "PersistentVolumeClaim", "StorageClass", "Bound",
}  # fmt: skip
CAMEL_WORD = re.compile(r"[A-Z][a-z]+(?:[A-Z][a-z]+)*")


def _python_files(*places: str) -> list[Path]:
    files: list[Path] = []
    for place in places:
        path = ROOT / place
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _exit_codes() -> set[int]:
    """Integer codes passed to typer.Exit / sys.exit / SystemExit, and the EXIT_* constants."""
    trees = [ast.parse(path.read_text(encoding="utf-8")) for path in _python_files(*EXIT_CODE_SOURCES)]
    constants: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                        constants[target.id] = node.value.value
    codes = set(constants.values())
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = ast.unparse(node.func)
            if name not in ("typer.Exit", "sys.exit", "SystemExit", "os._exit"):
                continue
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, int):
                codes.add(argument.value)
            elif isinstance(argument, ast.Name) and argument.id in constants:
                codes.add(constants[argument.id])
    return codes


def _operator_words() -> set[str]:
    words: set[str] = set()
    for path in _python_files(*REASON_SOURCES):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CAMEL_WORD.fullmatch(node.value):
                words.add(node.value)
    return (words | REASON_CONSTANTS) - KUBERNETES_WORDS


def test_every_exit_code_has_a_row():
    page = PAGE.read_text(encoding="utf-8")
    codes = _exit_codes()
    assert {0, 1, 2, 78, 130} <= codes
    missing = [code for code in sorted(codes) if f"| `{code}` |" not in page]
    assert not missing, f"exit codes missing from docs/troubleshooting.md#exit-codes: {missing}"


def test_every_phase_condition_and_reason_the_operator_writes_is_explained():
    page = PAGE.read_text(encoding="utf-8")
    words = _operator_words()
    assert {"Unschedulable", "CrashLoopBackOff", "BackoffLimitExceeded", "InvalidConfig", "Running"} <= words
    missing = sorted(word for word in words if f"`{word}`" not in page)
    assert not missing, f"operator phases/conditions/reasons missing from docs/troubleshooting.md: {missing}"
