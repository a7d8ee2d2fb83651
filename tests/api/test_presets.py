"""Every algorithm brings its paper's defaults; a field the user sets always wins; render and validate show both."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rljob.algorithms import gspo_policy_loss, ppo_policy_loss
from rljob.api import validate_job
from rljob.api.presets import PRESETS
from rljob.cli.main import app
from rljob.operator.manifests.config import resolved_job_document
from tests.conftest import REPO

PRESET_KEYS = ("lossAggregation", "clipRatioLow", "clipRatioHigh", "klCoef", "normalizeAdvantages", "dynamicSampling")

# name: (aggregation, clip low, clip high, KL, std-normalised, dynamic sampling, overlong) as the papers state them.
PAPER_DEFAULTS: dict[str, tuple[str, float, float, float, bool, bool, bool]] = {
    "ppo": ("token-mean", 0.2, 0.2, 0.0, True, False, False),
    "grpo": ("seq-mean-token-mean", 0.2, 0.2, 0.04, True, False, False),
    "dr_grpo": ("seq-mean-token-sum-norm", 0.2, 0.2, 0.0, False, False, False),
    "dapo": ("token-mean", 0.2, 0.28, 0.0, True, True, True),
    "rloo": ("seq-mean-token-sum", 0.2, 0.2, 0.0, False, False, False),
    "reinforce_pp": ("token-mean", 0.2, 0.2, 0.0, True, False, False),
    "gspo": ("seq-mean-token-mean", 3e-4, 4e-4, 0.0, True, False, False),
    "cispo": ("token-mean", 0.2, 0.28, 0.0, True, True, True),
    "distill": ("token-mean", 0.2, 0.2, 0.0, False, False, False),
}


def llm_manifest(name: str, **algorithm: Any) -> dict[str, Any]:
    """The tiny arithmetic example with only `name` (and `algorithm`) in its algorithm section, 1000 tokens long."""
    manifest = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    manifest["spec"]["algorithm"] = {"name": name, "groupSize": 8, **algorithm}
    if name == "distill":
        manifest["spec"]["algorithm"].setdefault("distill", {"teacher": {"path": "/models/teacher"}})
    manifest["spec"]["task"]["llm"]["maxResponseLength"] = 1000
    return manifest


def gym_manifest(**algorithm: Any) -> dict[str, Any]:
    manifest = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    for key in ("clipRatioLow", "clipRatioHigh"):
        manifest["spec"]["algorithm"].pop(key)
    manifest["spec"]["algorithm"].update(algorithm)
    return manifest


def resolved(algorithm: Any) -> tuple[str, float, float, float, bool, bool, bool]:
    return (
        algorithm.loss_aggregation,
        algorithm.clip_ratio_low,
        algorithm.clip_ratio_high,
        algorithm.kl_coef,
        algorithm.normalize_advantages,
        algorithm.dynamic_sampling,
        algorithm.overlong is not None and algorithm.overlong.enabled,
    )


def test_every_algorithm_has_a_preset_with_a_paper_reference():
    assert set(PRESETS) == set(PAPER_DEFAULTS)
    assert all("arXiv:" in preset.reference for preset in PRESETS.values())


@pytest.mark.parametrize("name", [n for n in PAPER_DEFAULTS if n != "ppo"])
def test_an_unset_algorithm_resolves_to_its_paper_defaults(name: str):
    assert resolved(validate_job(llm_manifest(name)).spec.algorithm) == PAPER_DEFAULTS[name]


def test_ppo_on_a_gym_task_resolves_to_the_ppo_paper():
    assert resolved(validate_job(gym_manifest()).spec.algorithm) == PAPER_DEFAULTS["ppo"]


def test_gspo_aggregates_per_sequence_as_its_paper():
    """Issue 18.1: GSPO's loss is 1/G sum over sequences of the token mean, not a mean over all tokens."""
    algorithm = validate_job(llm_manifest("gspo")).spec.algorithm
    # Sequence 1 has 3 tokens of advantage +1, sequence 2 one token of -1; at ratio 1 the loss per token is -A.
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0])
    loss, _ = gspo_policy_loss(
        logprobs,
        logprobs,
        advantages,
        algorithm.clip_ratio_low,
        algorithm.clip_ratio_high,
        mask=mask,
        aggregation=algorithm.loss_aggregation,
    )
    # seq-mean-token-mean: (-1 + 1) / 2 = 0; token-mean would give (-3 + 1) / 4 = -0.5.
    assert float(loss) == pytest.approx(0.0, abs=1e-7)


def test_dapo_clips_higher_at_0_28():
    """Issue 18.2: a ratio of 1.25 on a positive advantage is inside DAPO's [0.8, 1.28], so it is not clipped."""
    algorithm = validate_job(llm_manifest("dapo")).spec.algorithm
    logprobs, old = torch.log(torch.tensor([1.25])), torch.zeros(1)
    loss, stats = ppo_policy_loss(logprobs, old, torch.ones(1), algorithm.clip_ratio_low, algorithm.clip_ratio_high)
    assert float(loss) == pytest.approx(-1.25)  # with clipRatioHigh 0.2 it would be -1.2
    assert float(stats["clip_fraction"]) == 0.0


def test_dapo_overlong_buffer_is_a_fifth_of_the_response_budget():
    overlong = validate_job(llm_manifest("dapo")).spec.algorithm.overlong
    assert overlong is not None and (overlong.buffer, overlong.penalty) == (200, 1.0)


def test_dapo_overlong_buffer_is_a_fifth_of_the_response_a_shorter_max_tokens_allows():
    """rollout.maxTokens below maxResponseLength: the buffer is a fifth of what a rollout generates (a fifth of
    maxResponseLength would be over maxTokens, where the penalty cannot ramp); with a text environment it is the
    whole episode's maxResponseLength, which maxTokens caps per turn."""
    manifest = llm_manifest("dapo")
    manifest["spec"]["rollout"]["maxTokens"] = 100
    overlong = validate_job(manifest).spec.algorithm.overlong
    assert overlong is not None and overlong.buffer == 20
    calculator = yaml.safe_load((REPO / "examples" / "grpo-tiny-calculator.yaml").read_text())
    calculator["spec"]["algorithm"] = {"name": "dapo", "groupSize": 4}
    overlong = validate_job(calculator).spec.algorithm.overlong
    assert overlong is not None and overlong.buffer == 6  # a fifth of maxResponseLength 32, not of maxTokens 16


def test_an_overlong_buffer_that_a_shorter_max_tokens_never_reaches_is_refused_naming_both_fields():
    from rljob.api.problems import InvalidRLJob

    manifest = llm_manifest("grpo", overlong={"buffer": 150})
    manifest["spec"]["rollout"]["maxTokens"] = 100
    with pytest.raises(InvalidRLJob) as refused:
        validate_job(manifest)
    assert [p.path for p in refused.value.problems] == ["spec.algorithm.overlong.buffer"]
    assert "must be below rollout.maxTokens 100" in str(refused.value)


@pytest.mark.parametrize(
    ("name", "explicit", "field"),
    [
        ("gspo", {"lossAggregation": "token-mean"}, "loss_aggregation"),
        ("dapo", {"clipRatioHigh": 0.2}, "clip_ratio_high"),
        ("grpo", {"klCoef": 0.0}, "kl_coef"),
        ("dr_grpo", {"normalizeAdvantages": True}, "normalize_advantages"),
        ("dapo", {"dynamicSampling": False}, "dynamic_sampling"),
    ],
)
def test_an_explicit_field_wins_over_the_preset(name: str, explicit: dict[str, Any], field: str):
    algorithm = validate_job(llm_manifest(name, **explicit)).spec.algorithm
    assert getattr(algorithm, field) == next(iter(explicit.values()))


def test_overlong_enabled_false_turns_dapo_shaping_off_and_an_explicit_buffer_is_kept():
    off = validate_job(llm_manifest("dapo", overlong={"enabled": False})).spec.algorithm.overlong
    assert off is not None and not off.enabled
    mine = validate_job(llm_manifest("grpo", overlong={"buffer": 50, "penalty": 0.5})).spec.algorithm.overlong
    assert mine is not None and (mine.enabled, mine.buffer, mine.penalty) == (True, 50, 0.5)


@pytest.mark.parametrize("name", list(PAPER_DEFAULTS))
def test_the_resolved_config_the_roles_read_keeps_the_resolved_values(name: str):
    """The ConfigMap holds the resolved job: validated again in the pods, it must mean the same job."""
    manifest = gym_manifest() if name == "ppo" else llm_manifest(name, overlong={"enabled": False})
    job = validate_job(manifest)
    document = copy.deepcopy(resolved_job_document(job))
    document["apiVersion"], document["kind"] = manifest["apiVersion"], manifest["kind"]
    assert validate_job(document).spec.algorithm == job.spec.algorithm


def render_job(tmp_path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = CliRunner().invoke(app, ["render", "--only", "job", str(path)])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout), result.output


def test_render_shows_the_preset_of_the_algorithm(tmp_path: Path):
    rendered, _ = render_job(tmp_path, llm_manifest("gspo"))
    algorithm = rendered["spec"]["algorithm"]
    assert {key: algorithm[key] for key in PRESET_KEYS} == {
        "lossAggregation": "seq-mean-token-mean",
        "clipRatioLow": 0.0003,
        "clipRatioHigh": 0.0004,
        "klCoef": 0.0,
        "normalizeAdvantages": True,
        "dynamicSampling": False,
    }
    rendered, _ = render_job(tmp_path, llm_manifest("dapo"))
    assert rendered["spec"]["algorithm"]["overlong"] == {"enabled": True, "buffer": 200, "penalty": 1.0}


def validate(tmp_path: Path, manifest: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    return result.output


def test_validate_notes_when_a_choice_departs_from_the_paper(tmp_path: Path):
    output = validate(tmp_path, llm_manifest("grpo", clipRatioHigh=0.28, klCoef=0.0))
    assert (
        "note: " in output
        and "spec.algorithm: clipRatioHigh 0.28 (paper: 0.2), klCoef 0.0 (paper: 0.04) depart from grpo's paper "
        "defaults (Shao et al. 2024, DeepSeekMath (arXiv:2402.03300))"
        in output
    )
    output = validate(tmp_path, llm_manifest("grpo", overlong={"buffer": 50}))
    assert "overlong on (paper: off)" in output


@pytest.mark.parametrize("name", [n for n in PAPER_DEFAULTS if n != "ppo"])
def test_validate_is_quiet_for_the_paper_defaults_even_when_written_out(tmp_path: Path, name: str):
    aggregation, low, high, kl, normalize, dynamic, _ = PAPER_DEFAULTS[name]
    explicit = {"lossAggregation": aggregation, "clipRatioLow": low, "clipRatioHigh": high, "klCoef": kl}
    explicit |= {"normalizeAdvantages": normalize, "dynamicSampling": dynamic}
    assert "depart" not in validate(tmp_path, llm_manifest(name))
    assert "depart" not in validate(tmp_path, llm_manifest(name, **explicit))


def preset_table(path: Path) -> dict[str, list[str]]:
    """The rows of the algorithm table between the algorithm-presets markers, by algorithm name."""
    text = path.read_text()
    table = text[text.index("<!-- algorithm-presets") : text.index("<!-- end algorithm-presets -->")]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells[1:]] for cells in rows}


@pytest.mark.parametrize("page", ["docs/algorithms.md"])
def test_the_documented_table_is_the_presets(page):
    table = preset_table(REPO / page)
    assert set(table) == set(PRESETS)
    for name, preset in PRESETS.items():
        aggregation, clips, kl, normalize, dynamic, overlong, paper = table[name]
        assert aggregation == preset.loss_aggregation
        assert [float(x) for x in clips.split(" / ")] == [preset.clip_ratio_low, preset.clip_ratio_high]
        assert float(kl) == preset.kl_coef
        assert normalize.split(" ")[0] == str(preset.normalize_advantages).lower()
        assert dynamic == str(preset.dynamic_sampling).lower()
        assert overlong == ("on" if preset.overlong else "off")
        assert paper == preset.reference


def test_the_readme_and_the_llm_guide_link_the_algorithms_page():
    readme = (REPO / "README.md").read_text()
    assert "(docs/algorithms.md)" in readme
    assert all(f"`{name}`" in readme for name in PRESETS)  # the README names every algorithm
    assert "(../algorithms.md)" in (REPO / "docs" / "guides" / "llm-jobs.md").read_text()


def test_render_and_run_do_not_repeat_the_departures_validate_notes(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(llm_manifest("grpo", clipRatioHigh=0.28, klCoef=0.0)))
    result = CliRunner().invoke(app, ["render", str(path), "--only", "job"])
    assert result.exit_code == 0 and "depart" not in result.stderr, result.stderr
