"""Block YAML for plain data (what `model_dump(mode="json")` returns), written directly.

PyYAML's dumper builds a node per value in Python before its emitter (libyaml's or not) writes them: 5-6 ms for
a resolved RLJob, a quarter of the operator's CPU for a job's first pass. Plain data needs no nodes: mappings and
sequences in block style, strings plain when they cannot read as anything else and double-quoted (JSON's escapes,
which YAML's double-quoted style shares) when they might. `yaml.safe_load` reads back exactly what was written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
"""Words a YAML 1.1 reader (PyYAML's) takes for booleans or null when they are not quoted."""
_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")
"""What JSON leaves as is but YAML reads as a line break or refuses in a stream: written as escapes."""


def _quoted(text: str) -> str:
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False))


def _string(text: str) -> str:
    if _PLAIN.fullmatch(text) and text.lower() not in _WORDS:
        return text
    return _quoted(text)


def _float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        # YAML 1.1 reads 1e-05 as a string: its floats need a point and a signed exponent.
        text = f"{mantissa}.0e{exponent if exponent[0] in '+-' else '+' + exponent}"
    return text


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    raise TypeError(f"not plain data: {type(value).__name__}")


def _lines(value: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"mapping keys must be strings, not {type(key).__name__}")
            if isinstance(item, dict | list) and item:
                out.append(f"{pad}{_string(key)}:")
                _lines(item, indent + 2, out)
            else:
                out.append(f"{pad}{_string(key)}: {_scalar(item)}")
        return
    for item in value:
        if isinstance(item, dict | list) and item:
            nested: list[str] = []
            _lines(item, indent + 2, nested)
            nested[0] = f"{pad}- {nested[0][indent + 2 :]}"
            out.extend(nested)
        else:
            out.append(f"{pad}- {_scalar(item)}")


def dump(value: Any) -> str:
    """`value` (dicts with string keys, lists, strings, numbers, booleans, None) as a YAML document."""
    if isinstance(value, dict | list) and value:
        out: list[str] = []
        _lines(value, 0, out)
        return "\n".join(out) + "\n"
    return _scalar(value) + "\n"
