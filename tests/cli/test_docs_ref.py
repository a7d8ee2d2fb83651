"""The generated reference pages match the code, and the spec reference covers the whole CRD."""

import re
from pathlib import Path

from rljob.cli import docs_ref

ROOT = Path(__file__).parents[2]


def test_spec_reference_is_up_to_date():
    committed = (ROOT / docs_ref.SPEC_REFERENCE).read_text(encoding="utf-8")
    assert committed == docs_ref.spec_reference(), f"{docs_ref.SPEC_REFERENCE} is stale: {docs_ref.REGENERATE}"


def test_cli_reference_is_up_to_date():
    committed = (ROOT / docs_ref.CLI_REFERENCE).read_text(encoding="utf-8")
    assert committed == docs_ref.cli_reference(), f"{docs_ref.CLI_REFERENCE} is stale: {docs_ref.REGENERATE}"


def test_spec_reference_covers_every_property_path_of_the_crd():
    documented = set(re.findall(r"^\| `([^`]+)` \|", (ROOT / docs_ref.SPEC_REFERENCE).read_text(), re.MULTILINE))
    crd_paths = docs_ref.crd_property_paths()
    assert len(crd_paths) > 300
    missing = [path for path in crd_paths if path not in documented and docs_ref.shared_path(path) not in documented]
    assert not missing, f"fields of `rljob crd` missing from the spec reference ({docs_ref.REGENERATE}): {missing}"


def test_fields_every_role_shares_are_listed_once_and_role_defaults_apart():
    rows = {row.path: row for row in docs_ref.spec_rows()}
    assert "spec.roles.<role>.placement.gpuProduct" in rows
    assert "spec.roles.actor.placement.gpuProduct" not in rows
    assert rows["spec.roles.actor.replicas"].default == "`1`"
    assert rows["spec.roles.env.replicas"].default == ""


def test_spec_rows_carry_type_default_bounds_and_description():
    rows = {row.path: row for row in docs_ref.spec_rows()}
    steps = rows["spec.trainer.steps"]
    assert (steps.type, steps.default, steps.bounds) == ("integer", "required", "≥ 1")
    assert "policy updates" in steps.description
    assert rows["spec.model.builtin.hiddenSizes"].default == "`[64, 64]`"  # a default_factory, absent from the CRD
    assert rows["spec.algorithm.clipRatioLow"].bounds == "> 0.0; < 1.0"
    assert rows["spec.scheduling.gang"].bounds.startswith("one of `none`")
    assert rows["spec.roles.<role>.resources.limits"].type == "map of integer or string"


def test_cli_reference_lists_every_command_and_option():
    text = docs_ref.cli_reference()
    for command in ("validate", "render", "run", "operator", "role", "crd", "version"):
        assert f"## rljob {command}\n" in text
    for option in ("`--set`", "`--ray`", "`--placement-timeout`", "`--all-namespaces`, `-A`", "`--only`"):
        assert option in text
    assert "runs/&lt;job&gt;-&lt;timestamp&gt;" in text  # angle brackets outside code are text, not HTML


def test_write_references_writes_only_what_changed(tmp_path):
    assert sorted(docs_ref.write_references(tmp_path)) == sorted(docs_ref.GENERATED_PAGES)
    assert docs_ref.write_references(tmp_path) == []


def test_every_field_has_a_description():
    blank = [row.path for row in docs_ref.spec_rows() if not row.description]
    assert not blank, f"fields without a description (add a docstring under the field in rljob/api): {blank}"
