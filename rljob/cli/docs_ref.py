"""The generated pages of the documentation site: the RLJob spec reference and the CLI reference.

Both are written from the code, never by hand: `docs/reference/spec.md` from the CRD schema that
`rljob crd` emits (itself generated from the pydantic models in `rljob/api`, so field names, types,
defaults, bounds and descriptions are the ones the API server enforces), and `docs/reference/cli.md`
from the typer application. `make docs-ref` (`python -m rljob.cli.docs_ref`) rewrites both; tests fail
when the committed pages differ from what this module generates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rljob.api.crd import Schema, openapi_schema
from rljob.api.job import API_VERSION, KIND, MAX_NAME_LENGTH, RLJob

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
SPEC_REFERENCE = Path("docs/reference/spec.md")
CLI_REFERENCE = Path("docs/reference/cli.md")
REGENERATE = "run `make docs-ref`"

ROLE_PLACEHOLDER = "<role>"
MAP_KEY = "<key>"
"""Stands for any key of a map whose values are objects (`status.replicaFailures.<key>.count`)."""
ROLE_MAPS = ("spec.roles", "status.roles")
"""Objects whose children are the four roles: fields every role shares are listed once as `<role>`."""

_ROOT_DESCRIPTIONS = {
    "apiVersion": f"`{API_VERSION}`.",
    "kind": f"`{KIND}`.",
    "metadata": (
        f"Standard Kubernetes object metadata. `metadata.name` is a DNS-1123 label of at most {MAX_NAME_LENGTH} "
        "characters, so that pod names `<job>-<role>-<i>` fit in 63."
    ),
}


@dataclass(frozen=True)
class FieldRow:
    """One documented field: where it is, what it takes, what it defaults to."""

    path: str
    type: str
    default: str
    bounds: str
    description: str


# --- spec reference ----------------------------------------------------------------------------------------------


def _model_defaults(model: type[BaseModel], prefix: str, into: dict[str, Any]) -> None:
    """Defaults the CRD schema cannot carry (pydantic `default_factory` values), by YAML path."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}.{key}" if prefix else key
        if field.default_factory is not None:
            into[path] = field.default_factory()  # type: ignore[call-arg]
        elif field.default is not PydanticUndefined:
            into[path] = field.default
        for nested, suffix in _nested_models(field.annotation):
            _model_defaults(nested, path + suffix, into)


def _nested_models(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The models inside an annotation, with the path suffix of each (`[]` for list items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
        return
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        for argument in get_args(annotation):
            yield from _nested_models(argument)
    elif origin is list:
        for model, suffix in _nested_models(get_args(annotation)[0]):
            yield model, "[]" + suffix


def shared_path(path: str) -> str:
    """`spec.roles.env.image` -> `spec.roles.<role>.image`; other paths unchanged."""
    for prefix in ROLE_MAPS:
        if path.startswith(prefix + "."):
            rest = path[len(prefix) + 1 :]
            _, _, tail = rest.partition(".")
            return f"{prefix}.{ROLE_PLACEHOLDER}.{tail}" if tail else path
    return path


def crd_property_paths(schema: Schema | None = None) -> list[str]:
    """Every property path of the CRD's schema, dotted in camelCase as in YAML (`[]` marks list items)."""
    paths: list[str] = []

    def walk(node: Schema, prefix: str) -> None:
        for name, child in node.get("properties", {}).items():
            path = f"{prefix}.{name}" if prefix else name
            paths.append(path)
            walk(child, path)
        if isinstance(node.get("items"), dict):
            walk(node["items"], prefix + "[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{prefix}.{MAP_KEY}")

    walk(schema if schema is not None else openapi_schema(), "")
    return paths


def _schema_at(schema: Schema, path: str) -> Schema:
    node = schema
    for part in path.split("."):
        name = part.removesuffix("[]")
        node = node["additionalProperties"] if name == MAP_KEY else node["properties"][name]
        for _ in range(part.count("[]")):
            node = node["items"]
    return node


def _type_text(node: Schema) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free-form)"
    kind = node.get("type", "object")
    if kind == "array":
        return f"list of {_plural(_type_text(node.get('items', {})))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type_text(node['additionalProperties'])}"
    return kind


def _plural(text: str) -> str:
    return {"integer": "integers", "string": "strings", "number": "numbers", "boolean": "booleans"}.get(
        text, "objects" if text == "object" else text
    )


def _bounds_text(node: Schema) -> str:
    parts: list[str] = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{value}`" for value in node["enum"]))
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '≥'} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"{'<' if node.get('exclusiveMaximum') else '≤'} {node['maximum']}")
    for key, label in (("minLength", "length ≥"), ("maxLength", "length ≤"), ("minItems", "items ≥")):
        if key in node:
            parts.append(f"{label} {node[key]}")
    if "maxItems" in node:
        parts.append(f"items ≤ {node['maxItems']}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    items = node.get("items")
    if isinstance(items, dict) and (item_bounds := _bounds_text(items)):
        parts.append(f"each {item_bounds}")
    return "; ".join(parts)


def _one_line(text: str) -> str:
    """Text on one Markdown line, with `<...>` outside code spans shown as text rather than read as HTML."""
    pieces = " ".join(text.split()).split("`")
    for index in range(0, len(pieces), 2):
        pieces[index] = pieces[index].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(pieces)


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return _one_line(text).replace("|", "\\|")


def _default_text(path: str, node: Schema, required: bool, defaults: dict[str, Any]) -> str:
    if required:
        return "required"
    value = node.get("default", defaults.get(path))
    if value is None:
        return ""
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def spec_rows(schema: Schema | None = None) -> list[FieldRow]:
    """One row per field of the CRD schema; fields every role shares are one `<role>` row."""
    schema = schema if schema is not None else openapi_schema()
    defaults: dict[str, Any] = {}
    _model_defaults(RLJob, "", defaults)
    rows: dict[str, FieldRow] = {}
    for path in crd_property_paths(schema):
        node = _schema_at(schema, path)
        parent_path, _, name = path.rpartition(".")
        parent = _schema_at(schema, parent_path) if parent_path else schema
        required = name in parent.get("required", [])
        row = FieldRow(
            path=path,
            type=_type_text(node),
            default=_default_text(path, node, required, defaults),
            bounds=_bounds_text(node),
            description=node.get("description") or _ROOT_DESCRIPTIONS.get(path, ""),
        )
        shared = shared_path(path)
        if shared != path and _same_for_every_role(schema, path, defaults):
            rows.setdefault(shared, FieldRow(shared, row.type, row.default, row.bounds, row.description))
        else:
            rows[path] = row
    return list(rows.values())


def _same_for_every_role(schema: Schema, path: str, defaults: dict[str, Any]) -> bool:
    prefix = next(p for p in ROLE_MAPS if path.startswith(p + "."))
    roles = list(_schema_at(schema, prefix)["properties"])
    own_role = path[len(prefix) + 1 :].split(".")[0]
    variants = []
    for role in roles:
        other = path.replace(f"{prefix}.{own_role}", f"{prefix}.{role}", 1)
        try:
            node = _schema_at(schema, other)
        except KeyError:
            return False
        variants.append(json.dumps([node, defaults.get(other)], sort_keys=True, default=str))
    return len(set(variants)) == 1


def _section_of(path: str) -> str:
    parts = path.split(".")
    if parts[0] in ("spec", "status") and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in ("spec", "status") else "RLJob"


def _rules(schema: Schema) -> Iterator[tuple[str, str, str]]:
    """(path, rule, message) of every CEL validation rule in the schema."""

    def walk(node: Schema, path: str) -> Iterator[tuple[str, str, str]]:
        for rule in node.get("x-kubernetes-validations", []):
            yield path or "RLJob", rule["rule"], rule["message"]
        for name, child in node.get("properties", {}).items():
            yield from walk(child, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], path + "[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from walk(node["additionalProperties"], f"{path}.{MAP_KEY}")

    yield from walk(schema, "")


SPEC_INTRO = """\
Every field of an RLJob, generated from the API models in `rljob/api` (the same models `rljob crd` turns
into the CustomResourceDefinition the API server enforces). Paths are dotted as in YAML, in camelCase;
`[]` marks the items of a list and `<role>` stands for each of `actor`, `rollout`, `env` and `reward` where
they share a field. A default in the table is what the field takes when it is left out; *required* fields
have none. Sections default to `{}`, so their own defaults apply.

Some defaults depend on the task and are filled when a job is loaded (`rljob render` shows them):
`algorithm.groupSize` (1 for ppo, 8 for group algorithms), `rollout.engine` (torch for gym, vllm for llm),
`rollout.maxTokens` (`task.llm.maxResponseLength`), `roles.env.replicas` (1 for gym, 0 for llm; 1 with a text
environment), `roles.reward.replicas` (0 for gym, 1 for llm), `model.builtin.architecture` (mlp / tiny-qwen2),
`algorithm.dynamicSampling` (on for dapo, off otherwise). Rules that concern several fields are listed under
each section; `rljob validate` checks the same rules with the same wording, and more (see
[Troubleshooting](../troubleshooting.md)).
"""


def spec_reference(schema: Schema | None = None) -> str:
    """The Markdown of `docs/reference/spec.md`."""
    schema = schema if schema is not None else openapi_schema()
    sections: dict[str, list[FieldRow]] = {}
    # Within a section, what differs per role comes before what every role shares.
    for row in sorted(spec_rows(schema), key=lambda row: ROLE_PLACEHOLDER in row.path):
        sections.setdefault(_section_of(row.path), []).append(row)
    rules: dict[str, list[tuple[str, str, str]]] = {}
    for path, rule, message in _rules(schema):
        section = path if path == "RLJob" or path.count(".") == 1 else _section_of(path)
        entry = (shared_path(path), rule, message)
        if entry not in rules.setdefault(section, []):
            rules[section].append(entry)
    lines = [
        f"<!-- Generated by `make docs-ref` from rljob/api: do not edit by hand ({REGENERATE}). -->",
        "",
        "# RLJob spec reference",
        "",
        SPEC_INTRO,
    ]
    for section, section_rows in sections.items():
        lines += [f"## {section}", ""]
        node = schema if section == "RLJob" else _schema_at(schema, section)
        if description := node.get("description"):
            lines += [_one_line(description), ""]
        lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        for row in section_rows:
            lines.append(
                f"| `{row.path}` | {row.type} | {row.default} | {_cell(row.bounds)} | {_cell(row.description)} |"
            )
        lines.append("")
        if section in rules:
            lines += ["Rules:", ""]
            lines += [f"- {_one_line(f'`{path}`: {message} (`{rule}`)')}" for path, rule, message in rules[section]]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- CLI reference -----------------------------------------------------------------------------------------------


# typer (0.2x) runs on its own copy of click: parameters are read through what they say about themselves.
Parameter = Any


def _is_argument(param: Parameter) -> bool:
    return param.param_type_name == "argument"


def _is_flag(param: Parameter) -> bool:
    return bool(getattr(param, "is_flag", False))


def _param_name(param: Parameter) -> str:
    if _is_argument(param):
        return f"`{param.metavar or param.name.upper()}`"
    return ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])


def _param_type(param: Parameter) -> str:
    if _is_flag(param):
        return "flag"
    annotation = param.type_descriptor.annotation
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        text = "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    else:
        name = getattr(annotation, "__name__", str(annotation))
        text = {"str": "text", "int": "integer", "float": "number", "Path": "path"}.get(name, name)
    if param.multiple or param.nargs == -1:
        text += " (repeatable)"
    return text


def _param_default(param: Parameter) -> str:
    if _is_argument(param):
        return "required" if param.required else ""
    default = param.default
    if default is None or (_is_flag(param) and default is False):
        return ""
    return f"`{default.value if isinstance(default, Enum) else default}`"


def _usage(name: str, params: list[Parameter]) -> str:
    arguments = [
        (param.metavar or param.name.upper()) + ("..." if param.nargs == -1 else "")
        for param in params
        if _is_argument(param)
    ]
    return " ".join(["rljob", name, "[OPTIONS]", *arguments])


CLI_INTRO = """\
Generated from the `rljob` command line (typer). Every command also takes `--help`. Exit codes and what to do
about each are in [Troubleshooting](../troubleshooting.md#exit-codes).

What a command gives goes to stdout: `rljob run`'s results (how it ended, the figures, the paths of the model,
metrics, curve and logs), `rljob render`'s manifests, `rljob validate`'s `ok` lines. Progress, role logs, problems,
warnings and notes go to stderr. So `rljob run job.yaml > run.log` keeps exactly the results, and
`rljob render job.yaml | kubectl apply -f -` applies exactly the manifests.

Manifests and `--set` values are read as YAML 1.2 reads numbers, as `kubectl apply` does: `learningRate: 3e-4` is
a number (PyYAML alone, which follows YAML 1.1, would read it as a string).
"""


def cli_reference(app: typer.Typer | None = None) -> str:
    """The Markdown of `docs/reference/cli.md`."""
    if app is None:
        from rljob.cli.main import app
    root = typer.main.get_command(app)
    root_context = typer.Context(root, info_name="rljob")
    lines = [
        f"<!-- Generated by `make docs-ref` from rljob/cli: do not edit by hand ({REGENERATE}). -->",
        "",
        "# Command-line reference",
        "",
        CLI_INTRO,
        f"`rljob`: {root.help}",
        "",
    ]
    for name in root.list_commands(root_context):
        command = root.get_command(root_context, name)
        if command is None or command.hidden:
            continue
        context = typer.Context(command, info_name=name, parent=root_context)
        params = [p for p in command.get_params(context) if p.name != "help" and not getattr(p, "hidden", False)]
        lines += [f"## rljob {name}", "", "```console", _usage(name, params), "```", ""]
        lines += [(command.help or "").strip(), ""]
        if params:
            lines += ["| argument / option | type | default | help |", "|---|---|---|---|"]
            for param in params:
                help_text = getattr(param, "help", None) or ""
                lines.append(
                    f"| {_param_name(param)} | {_cell(_param_type(param))} | {_cell(_param_default(param))} "
                    f"| {_cell(help_text)} |"
                )
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


GENERATED_PAGES = {SPEC_REFERENCE: spec_reference, CLI_REFERENCE: cli_reference}


def write_references(root: Path = REPOSITORY_ROOT) -> list[Path]:
    """Rewrite every generated page under `root`; the pages whose content changed."""
    changed: list[Path] = []
    for relative, generate in GENERATED_PAGES.items():
        target = root / relative
        text = generate()
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            changed.append(relative)
    return changed


def main() -> None:
    changed = write_references()
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print("docs/reference is up to date")


if __name__ == "__main__":
    main()
