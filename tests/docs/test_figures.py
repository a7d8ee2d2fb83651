"""The figures the README and the docs quote for the shipped examples are the measured ones.

`make figures` runs the examples (benchmarks/example_figures.py) into benchmarks/results/examples.json and rewrites
every span marked `<!-- figure: KEY -->` ... `<!-- /figure -->` from it. Here: every marked span says what the JSON
renders, every example a page quotes has its runs in the JSON, and the phrases that quote such figures appear only
inside marked spans, so a number typed by hand cannot drift from the runs again.
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.example_figures import DOCS, EXAMPLES, MARKED, RESULTS, marked_spans, render_figure

RESULTS_JSON = json.loads(RESULTS.read_text())
PAGES = {page.relative_to(RESULTS.parents[2]).as_posix(): page.read_text() for page in DOCS}
# How the docs quote an example's run: a held-out or training accuracy going from one value to another, seconds of
# training, a return reached. Outside a marked span these are hand-typed figures (performance.md's tables quote
# the peer benchmarks' own JSON files, the vision-language guide dates each of its runs: reports, left to them).
QUOTED = re.compile(
    r"accuracy:? \d\.\d+ (?:\(first|->|→| at step)|\d s(?:econds)? of training|demo reaches|reaches ≥ ?\d",
)
EXEMPT = {"docs/performance.md", "docs/guides/vision-language.md"}


def test_the_docs_mark_the_figures_of_the_examples_they_quote():
    keys = [key for text in PAGES.values() for key, _ in marked_spans(text)]
    assert {key.rpartition(".")[0] for key in keys} >= {"grpo-tiny-arithmetic", "cartpole-ppo"}, keys


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_marked_figure_is_what_the_runs_gave(page: str):
    for key, body in marked_spans(PAGES[page]):
        assert body == render_figure(key, RESULTS_JSON), f"{page}: {key} (run `make figures` or its --docs)"


@pytest.mark.parametrize("page", sorted(set(PAGES) - EXEMPT))
def test_no_example_figure_is_quoted_outside_a_marked_span(page: str):
    unmarked = MARKED.sub("", PAGES[page])
    found = [line.strip() for line in unmarked.splitlines() if QUOTED.search(line)]
    assert not found, f"{page}: figures typed by hand; mark them (benchmarks/example_figures.py): {found}"


def test_every_example_in_the_json_ran_its_documented_seeds_healthily():
    for name, (manifest, seeds) in EXAMPLES.items():
        runs = RESULTS_JSON["examples"][name]["runs"]
        assert RESULTS_JSON["examples"][name]["manifest"] == manifest
        assert [r["seed"] for r in runs] == seeds, name
        # A shipped example that trains as intended is not flagged by the health checks.
        assert all(not r["health_flagged"] for r in runs), (name, [r["health_flagged"] for r in runs])
