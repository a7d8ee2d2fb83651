"""The user's own code named in a spec field: `path/to/file.py:NAME` or `package.module:NAME`.

Reward functions and text environments are both found this way; each caller checks what NAME must be.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_loaded_files = itertools.count()


def describe_exception(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


def load_user_module(
    ref: str,
    base_dir: Path | None,
    error: Callable[[str], Exception],
    example: str,
    role: str,
) -> tuple[ModuleType, str, str]:
    """(module, its location as written, NAME) for `ref`; `error(message)` is raised when it cannot be loaded.

    A relative file path is resolved against `base_dir` (default: the working directory). `example` names a
    file for the hint (e.g. `rewards.py`); `role` the role whose image must hold an importable package.
    """
    location, _, name = ref.rpartition(":")
    if location.endswith(".py"):
        base = Path.cwd() if base_dir is None else Path(base_dir)
        path = Path(location) if Path(location).is_absolute() else base / location
        if not path.is_file():
            raise error(f"file {location} does not exist (relative paths are resolved against {base})")
        unique = f"rljob_user_{next(_loaded_files)}_{path.stem}"
        spec = importlib.util.spec_from_file_location(unique, path)
        assert spec is not None and spec.loader is not None  # a .py file always has a source loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[unique]
            raise error(f"loading {path} failed: {describe_exception(exc)}") from None
        return module, location, name
    if "/" in location or not location:
        raise error(f"{ref!r}: a file reference must name a .py file, e.g. {example}:{name}")
    try:
        module = importlib.import_module(location)
    except Exception as exc:
        raise error(
            f"cannot import {location!r}: {describe_exception(exc)} (install it in the {role} role's image)"
        ) from None
    return module, location, name
