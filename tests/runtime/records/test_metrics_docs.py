from pathlib import Path

from rljob.runtime.records import metrics

DOC = Path(__file__).parents[3] / "docs" / "metrics.md"


def test_metrics_doc_lists_every_record_key_and_prometheus_name():
    text = DOC.read_text()
    for key, (prometheus_name, _) in metrics._GAUGES.items():
        assert f"`{key}`" in text, key
        assert prometheus_name in text, prometheus_name
    for phase in metrics.PHASES:
        assert metrics.phase_key(phase) in text
