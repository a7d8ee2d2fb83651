"""Operator settings from the RLJOB_OPERATOR_* variables the Helm chart sets."""

from __future__ import annotations

import pytest

from rljob.operator.settings import OperatorSettings, SettingsError


def test_settings_come_from_operator_variables_and_unset_ones_keep_defaults():
    settings = OperatorSettings.from_env(
        {
            "RLJOB_OPERATOR_TRAINER_IMAGE": "registry.local/trainer:1",
            "RLJOB_OPERATOR_IMAGE_PULL_POLICY": "Always",
            "RLJOB_OPERATOR_IMAGE_PULL_SECRETS": "regcred, other",
            "RLJOB_OPERATOR_RUN_AS_USER": "2000",
            "RLJOB_OPERATOR_GPU_SHARED_MEMORY": "false",
            "RLJOB_OPERATOR_EXTRA_POD_LABELS": "team=rl,tier=batch",
            "RLJOB_OPERATOR_ENV_IMAGE": "",
        }
    )
    assert settings.trainer_image == "registry.local/trainer:1"
    assert settings.image_pull_policy == "Always"
    assert settings.image_pull_secrets == ("regcred", "other")
    assert settings.run_as_user == 2000 and settings.gpu_shared_memory is False
    assert settings.extra_pod_labels == {"team": "rl", "tier": "batch"}
    assert settings.env_image == OperatorSettings().env_image


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("IMAGE_PULL_POLICY", "Sometimes", "must be one of Always, IfNotPresent, Never"),
        ("RUN_AS_USER", "root", "must be an integer"),
        ("RUN_AS_USER", "0", "non-root"),
        ("GPU_SHARED_MEMORY", "maybe", "true or false"),
        ("EXTRA_POD_LABELS", "team", "key=value"),
    ],
)
def test_a_bad_operator_variable_is_named_with_the_fix(name, value, message):
    with pytest.raises(SettingsError, match=f"RLJOB_OPERATOR_{name}.*{message}"):
        OperatorSettings.from_env({f"RLJOB_OPERATOR_{name}": value})
