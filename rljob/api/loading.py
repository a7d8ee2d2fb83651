"""Reading RLJob manifests: YAML with line numbers, schema validation, task defaults, cross rules."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob.api.job import API_VERSION, KIND, RLJob
from rljob.api.problems import InvalidRLJob, Problem, problems_from_validation_error, show
from rljob.api.rules import check, resolve_defaults


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one silently."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {seen[key].start_mark.line + 1}); keep only one",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass
class Document:
    """One YAML document of a manifest file, with its node tree for line numbers."""

    data: Any
    node: yaml.Node | None
    index: int


def parse_documents(text: str, source: str = "<input>") -> list[Document]:
    """All documents of a YAML stream; malformed YAML raises InvalidRLJob with line and column."""
    try:
        nodes = list(yaml.compose_all(text, Loader=_StrictLoader))
        docs = []
        for i, node in enumerate(nodes):
            loader = _StrictLoader("")
            data = loader.construct_document(node) if node is not None else None
            docs.append(Document(data, node, i))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        column = mark.column + 1 if mark else None
        detail = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        where = f" at line {line}, column {column}" if line else ""
        hint = "" if "duplicate key" in detail else " (check the indentation and the ':' after each key)"
        message = f"malformed YAML{where}: {detail}{hint}"
        raise InvalidRLJob([Problem("", message, line, column)], source) from None
    except yaml.YAMLError as exc:  # e.g. control characters, rejected before parsing starts
        raise InvalidRLJob([Problem("", f"malformed YAML: {exc}")], source) from None
    return [d for d in docs if d.data is not None]


def _line_of(node: yaml.Node | None, path: str) -> int | None:
    """The line of a dotted path's key, or of its deepest ancestor present in the document."""
    if node is None:
        return None
    current, line = node, node.start_mark.line + 1
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if isinstance(current, yaml.MappingNode) and not part.startswith("["):
            match = next(((k, v) for k, v in current.value if getattr(k, "value", None) == part), None)
            if match is None:
                break
            line, current = match[0].start_mark.line + 1, match[1]
        elif isinstance(current, yaml.SequenceNode) and part.startswith("["):
            index = int(part[1:-1])
            if index >= len(current.value):
                break
            current = current.value[index]
            line = current.start_mark.line + 1
        else:
            break
    return line


def _check_identity(data: Any) -> list[Problem]:
    if not isinstance(data, dict):
        return [Problem("", f"an RLJob manifest is a mapping with apiVersion, kind, metadata, spec (got {show(data)})")]
    problems = []
    if data.get("apiVersion") != API_VERSION:
        problems.append(Problem("apiVersion", f"must be {API_VERSION} (got {show(data.get('apiVersion'))})"))
    if data.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {show(data.get('kind'))})"))
    return problems


def validate_job(data: Any, *, source: str | None = None, node: yaml.Node | None = None) -> RLJob:
    """A valid, resolved RLJob from parsed YAML/JSON, or InvalidRLJob listing every problem."""
    problems = _check_identity(data)
    job: RLJob | None = None
    if not problems:
        try:
            job = RLJob.model_validate(data, by_alias=True, by_name=False)
        except ValidationError as exc:
            problems = problems_from_validation_error(exc, RLJob)
    if job is not None:
        job = resolve_defaults(job)
        problems = check(job)
    if problems:
        located = [Problem(p.path, p.message, p.line or _line_of(node, p.path)) for p in problems]
        raise InvalidRLJob(located, source)
    assert job is not None
    return job


def load_jobs(text: str, source: str = "<input>") -> list[RLJob]:
    """Every RLJob in a YAML stream; problems of all documents are reported together."""
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    docs = parse_documents(text, source)
    if not docs:
        raise InvalidRLJob([Problem("", "no YAML document found: expected an RLJob manifest")], source)
    for doc in docs:
        try:
            jobs.append(validate_job(doc.data, source=source, node=doc.node))
        except InvalidRLJob as exc:
            problems += exc.problems
    if problems:
        raise InvalidRLJob(problems, source)
    return jobs


def load_job_file(path: str | Path) -> RLJob:
    """The single RLJob in a file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidRLJob([Problem("", f"cannot read the file: {exc.strerror}")], str(path)) from None
    jobs = load_jobs(text, str(path))
    if len(jobs) != 1:
        raise InvalidRLJob([Problem("", f"expected one RLJob in the file, found {len(jobs)}")], str(path))
    return jobs[0]


def iter_job_files(paths: list[Path]) -> Iterator[tuple[Path, list[RLJob] | InvalidRLJob]]:
    for path in paths:
        try:
            yield path, load_jobs(path.read_text(), str(path))
        except InvalidRLJob as exc:
            yield path, exc
        except IsADirectoryError:
            fix = f"pass the manifests inside it, e.g. {path}/*.yaml"
            yield path, InvalidRLJob([Problem("", f"is a directory: {fix}")], str(path))
        except OSError as exc:
            yield path, InvalidRLJob([Problem("", f"cannot read the file: {exc.strerror}")], str(path))
