"""kopf settings for the operator's handlers: no diff base, since every handler only watches."""

from __future__ import annotations

import kopf

from rljob.operator import handlers
from rljob.operator.app import OperatorOptions, kopf_settings, registry_with_login


def test_the_operator_registers_only_watching_handlers_so_kopf_needs_no_diff_base() -> None:
    assert handlers.watch_only(registry_with_login())
    settings = kopf_settings(OperatorOptions(namespaces=("ns",)))
    assert isinstance(settings.persistence.diffbase_storage, handlers.NoDiffBase)


def test_a_registry_with_a_change_handler_is_not_watch_only() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry)

    @kopf.on.update("v1", "configmaps", registry=registry)
    def changed(**_: object) -> None:
        return None

    assert not handlers.watch_only(registry)


def test_without_a_diff_base_kopf_builds_no_copy_of_the_object() -> None:
    body = kopf.Body({"metadata": {"name": "x"}, "spec": {"big": list(range(1000))}})
    storage = handlers.NoDiffBase()
    assert storage.build(body=body) == {} and storage.fetch(body=body) == {}
