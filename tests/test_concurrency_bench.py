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


def test_markdown_sets_ours_beside_the_best_llama_server_setting():
    def phase(tps):
        return {"tokens_per_s": tps, "wall_s": 5.0, "latency_p50": 1.0, "latency_p90": 1.5, "identical": 16,
                "requests": 16}

    r = {"when": "now", "machine": "m", "command": "python -m bench.concurrency", "requests": 16,
         "workload": "tool_calls", "max_tokens": 64, "index": None,
         "settings": {"drafted, --parallel 4": {"solo_latency_p50": 0.5, "streams": {"1": phase(150.0),
                                                                                     "4": phase(300.0)}},
                      "llama-server plain, -np 4": {"solo_latency_p50": 0.9, "streams": {"1": phase(70.0),
                                                                                           "4": phase(120.0)}},
                      "llama-server ngram-simple, -np 4": {"solo_latency_p50": 0.8,
                                                           "streams": {"1": phase(90.0), "4": phase(100.0)}}}}
    text = markdown(r)
    assert "| 1 | 150.0 | llama-server ngram-simple, -np 4 | 90.0 | 1.67x |" in text  # the best at each count
    assert "| 4 | 300.0 | llama-server plain, -np 4 | 120.0 | 2.50x |" in text
    assert "| llama-server plain, -np 4 | 4 | 120.0 | 1.71x |" in text  # its own speed-up over its 1 stream
    del r["settings"]["llama-server plain, -np 4"], r["settings"]["llama-server ngram-simple, -np 4"]
    assert "best llama-server setting" not in markdown(r)  # no peer, no comparison


def test_run_phases_times_each_phase_and_checks_answers_against_solo():
    import threading

    from bench.concurrency import run_phases

    calls, lock = [], threading.Lock()

    def ask(i):  # request 3's answer changes once sent by several streams at once
        with lock:
            calls.append(i)
            crowded = len(calls) > 1 + 6
        return ("changed" if crowded and i == 3 else f"answer {i}"), 10

    out = run_phases(ask, 6, [1, 3])
    assert calls[:7] == [0, 0, 1, 2, 3, 4, 5]  # a warm-up, then each request alone
    assert out["streams"]["1"]["identical"] == 5 and out["streams"]["3"]["identical"] == 5
    assert out["streams"]["3"]["requests"] == 6 and out["streams"]["3"]["tokens_per_s"] > 0
    assert out["streams"]["3"]["tokens_per_s_range"] == [out["streams"]["3"]["tokens_per_s"]] * 2


def test_rounds_report_the_median_and_range_and_sum_the_answers():
    import time

    from bench.concurrency import markdown, run_phases

    count = {"n": 0}
    batcher = {"forwards": 0, "sequences": 0, "rows": 0}

    def ask(i):  # every request of the second timed round is slower (a slow spell of the machine)
        count["n"] += 1
        batcher["forwards"] += 1
        batcher["sequences"] += 1
        batcher["rows"] += 3
        time.sleep(0.004 if 1 + 4 + 4 < count["n"] <= 1 + 4 + 8 else 0.001)
        return f"answer {i}", 10

    out = run_phases(ask, 4, [2], rounds=3, batching=lambda: dict(batcher))
    x = out["streams"]["2"]
    low, high = x["tokens_per_s_range"]
    assert out["rounds"] == 3 and low < x["tokens_per_s"] <= high and high > 1.5 * low
    assert x["requests"] == 12 and x["identical"] == 12
    assert x["forwards"] == 12 and x["rows_per_forward"] == 3.0 and x["requests_per_forward"] == 1.0
    r = {"when": "now", "machine": "m", "command": "c", "requests": 4, "workload": "tool_calls", "max_tokens": 64,
         "index": None, "rounds": 3, "settings": {"drafted, --parallel 4": out}}
    text = markdown(r)
    assert f"| 2 | {x['tokens_per_s']:.1f} ({low:.1f}-{high:.1f}) |" in text and "3 timed rounds" in text


def test_the_recorded_command_names_paths_by_their_kind():
    from bench.concurrency import shown_command

    assert shown_command(["--llama-server", "/opt/x/llama-server", "--streams", "1", "4", "--out", "o",
                          "--index=/tmp/i"]) == \
        "python -m bench.concurrency --llama-server PATH --streams 1 4 --index DIR"
    assert shown_command([]) == "python -m bench.concurrency"
