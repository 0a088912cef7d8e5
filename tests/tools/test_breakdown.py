"""The TTFT breakdown (tools/bench/breakdown.py) from trace events (trace/timeline.py): segments on
the critical path add up to the client's TTFT; the timeline writes nothing unless SPARKRELAY_TRACE
is set."""

import pytest

from sparkrelay.tools.bench.breakdown import SEGMENTS, mean_breakdown, request_breakdown
from sparkrelay.trace import timeline


def ev(t, source, event, **fields):
    return {"t": t, "source": source, "event": event, **fields}


PD_EVENTS = [
    ev(10.000, "router", "in", rooms=[7]),
    ev(10.002, "prefill", "queued", rid="a", room=7),
    ev(10.002, "decode", "queued", rid="a", room=7),
    ev(10.003, "stage0", "chunk", rooms=[7], start=10.003, end=10.010),
    ev(10.010, "stage1", "chunk", rooms=[7], start=10.010, end=10.018),
    ev(10.011, "stage0", "send", room=7),
    ev(10.019, "stage1", "send", room=7),
    ev(10.021, "decode", "arrived", room=7),
    ev(10.024, "decode", "first_token", rid="a", room=7),
    ev(10.025, "decode", "committed", room=7),  # the KV is written after the first token left
    ev(10.025, "router", "replied", rooms=[7], side="prefill"),
    # the next request: outside the window
    ev(10.050, "stage0", "chunk", rooms=[9], start=10.050, end=10.060),
]


def test_pd_segments_add_up_to_the_ttft():
    b = request_breakdown(PD_EVENTS, 9.999, 10.026)
    assert [round(b[k], 3) for k in SEGMENTS] == [3.0, 1.0, 15.0, 3.0, 3.0, 2.0]
    assert sum(b[k] for k in SEGMENTS) == pytest.approx(27.0)
    assert b["router hop"] == pytest.approx(1.0) and b["transfer span"] == pytest.approx(10.0)
    assert b["stage0 busy"] == pytest.approx(7.0) and b["stage1 busy"] == pytest.approx(8.0)
    assert b["prefill reply"] == pytest.approx(1.0)


def test_aggregated_and_missing_events():
    agg = [
        ev(5.001, "aggregated", "queued", rid="a", room=0),
        ev(5.011, "aggregated", "first_token", rid="a", room=0),
    ]
    b = request_breakdown(agg, 5.0, 5.012)
    assert [round(b[k], 3) for k in SEGMENTS] == [1.0, 0.0, 10.0, 0.0, 0.0, 1.0]
    # no stage or decode events: no breakdown
    assert request_breakdown(PD_EVENTS[:3], 9.999, 10.026) is None
    assert (
        mean_breakdown([None, b, b])["compute"] == pytest.approx(10.0)
        and mean_breakdown([None]) is None
    )


def test_timeline_writes_only_when_set(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("router", "in", rooms=[1])
    assert not timeline.enabled() and not list(tmp_path.iterdir())
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "t"))
    timeline.mark("router", "in", rooms=[1])
    timeline.mark("decode", "arrived", t=1.5, room=1)
    events = timeline.read(str(tmp_path / "t"))
    assert [(e["source"], e["event"]) for e in events] == [("decode", "arrived"), ("router", "in")]
    assert events[0]["t"] == 1.5 and events[1]["rooms"] == [1]
