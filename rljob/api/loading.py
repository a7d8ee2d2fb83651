"""Reading RLJob manifests: YAML with line numbers, schema validation, task defaults, cross rules."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob.api.job import API_VERSION, KIND, RLJob
from rljob.api.problems import InvalidRLJob, Problem, problems_from_validation_error, show
from rljob.api.rules import check, resolve_defaults


class ManifestLoader(yaml.SafeLoader):
    """How every rljob command reads a manifest or a `--set` value: PyYAML's SafeLoader, rejecting duplicate keys
    instead of keeping the last one silently, and reading numbers such as `3e-4` as YAML 1.2 does (and so
    `kubectl apply`): PyYAML's YAML 1.1 rules read an exponent without a dot, or without a sign, as a string."""


def _construct_mapping(loader: ManifestLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
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


ManifestLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# The exponent forms YAML 1.1 misses (`3e-4`, `1e5`, `1.5e3`, `.5e-3`); the others keep PyYAML's resolvers.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _first in "-+.0123456789":
    # add_implicit_resolver appends; this one must win over the 1.1 resolvers of the same first character.
    ManifestLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, [_first])
    _resolvers = ManifestLoader.yaml_implicit_resolvers[_first]
    _resolvers.insert(0, _resolvers.pop())


def read_yaml_value(text: str) -> Any:
    """A YAML document or value (a `--set` right-hand side, a job ConfigMap's job.yaml) read as a manifest is."""
    return yaml.load(text, Loader=ManifestLoader)


@dataclass
class Document:
    """One YAML document of a manifest file, with its node tree for line numbers."""

    data: Any
    node: yaml.Node | None
    index: int


def parse_documents(text: str, source: str = "<input>") -> list[Document]:
    """All documents of a YAML stream; malformed YAML raises InvalidRLJob with line and column."""
    try:
        nodes = list(yaml.compose_all(text, Loader=ManifestLoader))
        docs = []
        for i, node in enumerate(nodes):
            loader = ManifestLoader("")
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


def _without(data: Any, locations: list[tuple[str | int, ...]]) -> Any | None:
    """A copy of `data` without the values at `locations`, or None when one of them is not in it."""
    pruned = copy.deepcopy(data)
    for location in locations:
        parent: Any = pruned
        for key in location[:-1]:
            try:
                parent = parent[key]
            except (KeyError, IndexError, TypeError):
                return None
        if not isinstance(parent, dict) or location[-1] not in parent:
            return None  # a list item, a union member's tag or a missing field: not something to take out
        del parent[location[-1]]
    return pruned


def _rule_problems_beside(data: Any, error: ValidationError, reported: list[Problem]) -> list[Problem]:
    """The cross-field problems of the rest of a manifest whose schema problems are `reported`.

    The values the schema refused are taken out (so their defaults stand in) and the rules run on what remains;
    a rule about a refused field, or about a field inside or around one, is left to the schema's problem. So a
    file with an unknown field and a wrong algorithm gets both problems at once, not one per fix."""
    pruned = _without(data, [tuple(e["loc"]) for e in error.errors(include_url=False)])
    if pruned is None:
        return []
    try:
        job = RLJob.model_validate(pruned, by_alias=True, by_name=False)
    except ValidationError:
        return []  # e.g. a required field is missing: nothing sound to check the rules on
    refused = [p.path for p in reported]

    def related(path: str) -> bool:
        return any(path == r or path.startswith(r + ".") or r.startswith(path + ".") for r in refused)

    return [p for p in check(resolve_defaults(job)) if not related(p.path)]


def validate_job(data: Any, *, source: str | None = None, node: yaml.Node | None = None) -> RLJob:
    """A valid, resolved RLJob from parsed YAML/JSON, or InvalidRLJob listing every problem."""
    problems = _check_identity(data)
    job: RLJob | None = None
    if not problems:
        try:
            job = RLJob.model_validate(data, by_alias=True, by_name=False)
        except ValidationError as exc:
            problems = problems_from_validation_error(exc, RLJob)
            problems += _rule_problems_beside(data, exc, problems)
    if job is not None:
        job = resolve_defaults(job, in_place=True)  # validated just now: no one else holds it
        problems = check(job)
    if problems:
        located = [Problem(p.path, p.message, p.line or _line_of(node, p.path)) for p in problems]
        raise InvalidRLJob(located, source)
    assert job is not None
    return job


Edit = Callable[[Any], Any]
"""A change made to each parsed document before it is validated (`--set`); raises InvalidRLJob to refuse."""


def load_jobs(text: str, source: str = "<input>", edit: Edit | None = None) -> list[RLJob]:
    """Every RLJob in a YAML stream; problems of all documents are reported together."""
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    docs = parse_documents(text, source)
    if not docs:
        raise InvalidRLJob([Problem("", "no YAML document found: expected an RLJob manifest")], source)
    for doc in docs:
        try:
            if edit is None:
                jobs.append(validate_job(doc.data, source=source, node=doc.node))
            else:  # the file's line numbers would point at values the edit replaced
                jobs.append(validate_job(edit(doc.data), source=source))
        except InvalidRLJob as exc:
            problems += exc.problems
    if problems:
        raise InvalidRLJob(problems, source)
    return jobs


def load_job_file(path: str | Path, edit: Edit | None = None) -> RLJob:
    """The single RLJob in a file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidRLJob([Problem("", f"cannot read the file: {exc.strerror}")], str(path)) from None
    jobs = load_jobs(text, str(path), edit)
    if len(jobs) != 1:
        raise InvalidRLJob([Problem("", f"expected one RLJob in the file, found {len(jobs)}")], str(path))
    return jobs[0]


def iter_job_files(paths: list[Path], edit: Edit | None = None) -> Iterator[tuple[Path, list[RLJob] | InvalidRLJob]]:
    for path in paths:
        try:
            yield path, load_jobs(path.read_text(), str(path), edit)
        except InvalidRLJob as exc:
            yield path, exc
        except IsADirectoryError:
            fix = f"pass the manifests inside it, e.g. {path}/*.yaml"
            yield path, InvalidRLJob([Problem("", f"is a directory: {fix}")], str(path))
        except OSError as exc:
            yield path, InvalidRLJob([Problem("", f"cannot read the file: {exc.strerror}")], str(path))
