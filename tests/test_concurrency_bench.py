"""bench.concurrency's report: what the server's shared forwards carried in each phase."""
from bench.concurrency import forwards_shared, markdown


def test_forwards_shared_is_the_phase_delta_of_the_batchers_counters():
    before = {"forwards": 10, "sequences": 20, "rows": 100, "members": 0}
    after = {"forwards": 20, "sequences": 53, "rows": 340, "members": 0}
    assert forwards_shared(before, after) == {"forwards": 10, "requests_per_forward": 3.3, "rows_per_forward": 24.0}
    assert forwards_shared(None, None) == {}  # --parallel 1: no batcher
    idle = forwards_shared(after, after)
    assert idle["forwards"] == 0 and idle["requests_per_forward"] is None


def test_markdown_reports_requests_and_rows_a_forward():
    phase = {"tokens_per_s": 200.0, "wall_s": 5.0, "latency_p50": 1.0, "latency_p90": 1.5, "identical": 16,
             "requests": 16}
    r = {"when": "now", "machine": "m", "command": "python -m bench.concurrency", "requests": 16,
         "workload": "tool_calls", "max_tokens": 64, "index": None,
         "settings": {"drafted, --parallel 4": {"solo_latency_p50": 0.5, "streams": {
                          "1": dict(phase, tokens_per_s=100.0, forwards=50, requests_per_forward=1.0,
                                    rows_per_forward=7.5),
                          "4": dict(phase, forwards=40, requests_per_forward=3.3, rows_per_forward=24.0)}},
                      "drafted, --parallel 1 (one at a time)": {"solo_latency_p50": 0.5, "streams": {"4": phase}}}}
    text = markdown(r)
    assert "| drafted, --parallel 4 | 4 | 200.0 | 2.00x | 1.00 / 1.50 | 2.00x | 16/16 | 3.30 / 24.0 |" in text
    assert "| drafted, --parallel 4 | 1 | 100.0 | 1.00x |" in text and "| 1.00 / 7.5 |" in text
    assert text.rstrip().endswith("| 16/16 | - |")
