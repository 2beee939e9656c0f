"""Run records and the pack's HTTP routes: state of stopped and resumed runs, malformed files, incremental
reads, the samples route; and (ComfyUI tier) a listing of 50 runs x 20,000 events beside /system_stats."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO  # noqa: F401  (puts the pack on sys.path as `ingraph_trainer`)

from ingraph_trainer.runner import routes  # noqa: E402
from ingraph_trainer.runner.run_record import INDEX_EVERY, RunRecords, json_dumps  # noqa: E402
from ingraph_trainer.trainer.run.events import read_events  # noqa: E402


def event_line(type_: str, time_: float = 1.0, **fields) -> str:
    return json.dumps({"v": 1, "type": type_, "time": time_, **fields}) + "\n"


def append(path: Path, text: str):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setattr(routes.paths, "runs_root", lambda: root)
    return root


@pytest.fixture
def records(monkeypatch):
    """A fresh record cache for the routes (the module-level one outlives a test)."""
    fresh = RunRecords()
    monkeypatch.setattr(routes, "RECORDS", fresh)
    return fresh


def test_stopped_then_resumed_run_is_running_and_can_be_stopped_again(runs_root, records):
    run = runs_root / "20260101-000000-resume-0001"
    run.mkdir()
    events = run / "events.jsonl"
    append(events, event_line("started", 100.0, total=50, start_step=0)
           + "".join(event_line("step", 100.0 + s, step=s, total=50, loss=0.5) for s in range(1, 6))
           + event_line("checkpoint", 106.0, step=5, path="x")
           + event_line("eval", 106.0, step=5, loss=0.25)
           + event_line("finished", 107.0, adapter="/models/loras/a.safetensors", steps=5, stopped=True))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / "trainer.pid").write_text(str(sleeper.pid))
        os.utime(run / "trainer.pid", (50.0, 50.0))  # written by the first launch, before it ended
        record = records.record(run)
        assert record["state"] == "stopped" and record["step"] == 5
        assert records.record(run)["artifacts"]["adapter"].endswith("a.safetensors")
        body, status = routes._request_stop(run.name)
        assert status == 409 and not (run / "STOP").exists()

        # the launcher rewrites trainer.pid for the resumed trainer: running before its `started` event
        os.utime(run / "trainer.pid", None)
        assert records.record(run)["state"] == "running"
        append(events, event_line("started", 200.0, total=50, start_step=5, resumed_from="step_000005"))
        record = records.record(run)
        assert record["state"] == "running" and record["step"] == 5 and record["total"] == 50
        append(events, "".join(event_line("step", 200.0 + s, step=s, total=50, loss=0.4) for s in range(6, 9)))
        record = records.record(run)
        assert record["state"] == "running" and record["step"] == 8
        assert record["artifacts"]["adapter"] is None  # the resumed run has not written one yet
        assert record["best_eval"] == {"step": 5, "loss": 0.25}  # whole-run things span both runs
        victim = run.parent.parent / "victim.txt"
        victim.write_text("precious")
        (run / "STOP").symlink_to(victim)  # a planted STOP link must not truncate what it points at
        body, status = routes._request_stop(run.name)
        assert status == 500 and victim.read_text() == "precious"
        (run / "STOP").unlink()
        body, status = routes._request_stop(run.name)
        assert status == 200 and body["stop_requested"] and (run / "STOP").is_file()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert records.record(run)["state"] == "interrupted"  # the resumed trainer died without an end event
    append(events, event_line("finished", 300.0, adapter="/models/loras/a.safetensors", steps=8, stopped=True))
    assert records.record(run)["state"] == "stopped"


def test_malformed_lines_and_damaged_files_are_tolerated(runs_root, records):
    run = runs_root / "20260101-000000-broken-0001"
    run.mkdir()
    (run / "events.jsonl").write_bytes(
        event_line("started", total=10, start_step=0).encode()
        + b"not json\n" + b"[1, 2]\n" + b'"a string"\n' + b'{"type": 7}\n' + b'{"type": "nonsense"}\n'
        + b'{"type": "step"}\n' + b'{"type": "step", "step": "3", "loss": "x"}\n'
        + b'{"type": "step", "step": true}\n' + b'{"type": "eval", "step": 2, "loss": NaN}\n'
        + b'{"type": "eval", "step": 1, "loss": "low"}\n' + b'{"type": "sample", "images": "x.png"}\n'
        + b'{"type": "sample", "images": [3, null, "samples/ok.png"]}\n' + b"\xff\xfe\n" + b"[" * 100_000 + b"\n"
        + event_line("step", step=2, total=10, loss=float("nan")).encode()
        + b'{"type": "step", "step": true}\n' + b'{"type": "step", "step": -4}\n'
        + b'{"type": "finished", "stopped": "yes", "adapter": 5}\n')
    (run / "owner.json").write_text('{"node": ["not", "an id"]}')
    for pid in ("-1", "0", "abc", "99999999999999999999", "1" * 100):
        (run / "trainer.pid").write_text(pid)
        record = records.record(run)
        json.loads(json_dumps(record))  # a browser can parse it: no NaN
        assert record["state"] == "finished" and record["node"] is None
        assert record["step"] == 2 and record["best_eval"] is None
        assert record["artifacts"]["adapter"] is None and record["artifacts"]["samples"] == ["samples/ok.png"]
    # the events route and the listing count the same events as the trainer's own reader
    assert record["events"] == 12  # objects of a known type, whatever their fields
    events, total = records.events(run, 0, 1000)
    assert total == record["events"] == len(events)
    (run / "owner.json").write_bytes(b"\x00" * 10)
    (runs_root / "not a run id").mkdir()
    (runs_root / "20260101-000000-file").write_text("a file, not a run")
    listing = records.listing(runs_root)
    assert [r["id"] for r in listing] == [run.name]


def test_fifo_events_file_does_not_block(runs_root, records):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    run = runs_root / "20260101-000000-fifo-0001"
    run.mkdir()
    os.mkfifo(run / "events.jsonl")
    found = []
    reader = threading.Thread(target=lambda: found.append(records.record(run)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert found and found[0]["state"] == "pending"
    try:  # frees a reader that blocked (when this test fails); no reader: ENXIO
        os.close(os.open(run / "events.jsonl", os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_record_and_pages_of_a_file_read_in_small_chunks(runs_root, records, monkeypatch):
    """Lines split across reads, and a line too long to be an event, also across two updates."""
    from ingraph_trainer.runner import run_record
    monkeypatch.setattr(run_record, "READ_CHUNK", 97)
    monkeypatch.setattr(run_record, "MAX_LINE", 500)
    run = runs_root / "20260101-000000-chunks-0001"
    run.mkdir()
    events = run / "events.jsonl"
    append(events, event_line("started", total=100, start_step=0)
           + "".join(event_line("step", step=s, total=100, loss=1.0) for s in range(1, 40)))
    assert records.record(run)["events"] == 40 and records.record(run)["step"] == 39
    long_line = event_line("log", message="x" * 2000)
    append(events, long_line[:1200])  # an over-long line being written
    assert records.record(run)["events"] == 40
    append(events, long_line[1200:] + event_line("step", step=40, total=100, loss=1.0))
    record = records.record(run)
    assert record["events"] == 41 and record["step"] == 40
    page, total = records.events(run, 35, 10)
    assert total == 41 and [e["step"] for e in page] == [35, 36, 37, 38, 39, 40]


def test_incremental_update_reads_only_appended_bytes(runs_root, records):
    run = runs_root / "20260101-000000-grow-0001"
    run.mkdir()
    events = run / "events.jsonl"
    append(events, event_line("started", total=100000, start_step=0)
           + "".join(event_line("step", step=s, total=100000, loss=1.0) for s in range(1, 3000)))
    summary = records.summary(run)
    assert records.record(run)["events"] == 3000 and summary.bytes_read == events.stat().st_size
    read_before = summary.bytes_read
    assert records.record(run)["step"] == 2999 and summary.bytes_read == read_before  # unchanged: nothing read

    added = "".join(event_line("step", step=s, total=100000, loss=1.0) for s in range(3000, 3005))
    append(events, added)
    assert records.record(run)["step"] == 3004 and summary.bytes_read == read_before + len(added)

    half = event_line("step", step=3005, total=100000, loss=1.0)
    append(events, half[:20])  # a line being written is not an event yet
    assert records.record(run)["events"] == 3005
    append(events, half[20:])
    assert records.record(run)["events"] == 3006 and records.record(run)["step"] == 3005

    # a file replaced (another inode, or rewritten shorter) is read from its start
    events.unlink()
    replaced = event_line("started", total=7, start_step=0) + event_line("step", step=1, total=7, loss=1.0)
    append(events, replaced)
    read_before = summary.bytes_read
    record = records.record(run)
    assert record["events"] == 2 and record["step"] == 1 and record["total"] == 7
    assert summary.bytes_read == read_before + len(replaced)


def test_events_pages_match_the_trainer_reader(runs_root, records):
    run = runs_root / "20260101-000000-pages-0001"
    run.mkdir()
    lines = [event_line("started", total=5000, start_step=0)]
    for s in range(1, 3 * INDEX_EVERY + 10):
        lines.append(event_line("step", step=s, total=5000, loss=1.0))
        if s % 500 == 0:
            lines.append("garbage line\n")
    (run / "events.jsonl").write_text("".join(lines))
    everything = read_events(run / "events.jsonl")
    for since, limit in ((0, 5), (INDEX_EVERY - 2, 7), (2 * INDEX_EVERY + 3, 2000), (len(everything) - 1, 9),
                         (len(everything) + 5, 10)):
        page, total = records.events(run, since, limit)
        assert total == len(everything) and page == everything[since:since + limit]


def test_samples_route_refuses_symlinks_and_other_files(runs_root, records, tmp_path):
    run = runs_root / "20260101-000000-samples-0001"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "step000002_0.png").write_bytes(b"\x89PNG real")
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG secret outside the run")
    (run / "samples" / "link.png").symlink_to(secret)
    (run / "samples" / "notes.txt").write_text("x")
    (run / "samples" / ".hidden.png").write_bytes(b"x")
    assert routes._read_sample(run, "step000002_0.png") == b"\x89PNG real"
    for name in ("link.png", "notes.txt", ".hidden.png", "../run.png", "..\\x.png", "missing.png", "a/b.png"):
        assert routes._read_sample(run, name) is None, name
    other = runs_root / "20260101-000000-samples-0002"
    other.mkdir()
    (other / "samples").symlink_to(run / "samples", target_is_directory=True)  # a symlinked samples folder
    assert routes._read_sample(other, "step000002_0.png") is None


# ---------------------------------------------------------------------------------------------- ComfyUI tier

PLANTED_RUNS, PLANTED_EVENTS = 50, 20_000


def plant_runs(root: Path) -> dict[str, int]:
    """50 runs of 20,000 events written directly (fast): run i's last step is 19,999 - i. Returns id -> step."""
    step = ('{"v": 1, "type": "step", "time": 1700000000.0, "step": %d, "total": 20000, "loss": 0.%04d, '
            '"lr": 0.0001, "grad_norm": 0.5, "samples_per_s": 12.5, "step_time_s": 0.08, "eta_s": 100.0}\n')
    steps = [step % (s, s % 10000) for s in range(1, PLANTED_EVENTS)]
    started = event_line("started", 1700000000.0, total=20000, start_step=0)
    expected = {}
    for i in range(PLANTED_RUNS):
        run = root / f"20000101-000000-planted-{i:02d}"
        run.mkdir(parents=True)
        logs = "".join(event_line("log", message="x") for _ in range(i))
        (run / "events.jsonl").write_text(started + "".join(steps[:PLANTED_EVENTS - 1 - i]) + logs)
        (run / "owner.json").write_text('{"node": "planted"}')
        expected[run.name] = PLANTED_EVENTS - 1 - i
    return expected


def p95(timings: list[float]) -> float:
    """The nearest-rank 95th percentile: the smallest value at least 95 % of the timings do not exceed."""
    import math
    return sorted(timings)[math.ceil(0.95 * len(timings)) - 1]


@pytest.mark.comfyui
def test_listing_50_runs_of_20000_events_keeps_the_server_responsive(comfy, tmp_path):
    root = comfy.base_dir / "output" / "ingraph" / "runs"
    expected = plant_runs(root)
    broken = root / "20000101-000000-planted-00"
    append(broken / "events.jsonl", "{not json\n" + '{"type": "step", "step": "x"}\n')
    (broken / "samples").mkdir()
    secret = tmp_path / "outside.png"
    secret.write_bytes(b"\x89PNG outside")
    (broken / "samples" / "leak.png").symlink_to(secret)
    base = f"http://{comfy.address}"
    try:
        def get(path: str):
            with urllib.request.urlopen(base + path, timeout=120) as resp:
                return resp.status, resp.read()

        listing_done = threading.Event()
        stats_timings: list[float] = []

        def poll_stats():
            while not listing_done.is_set():
                t0 = time.perf_counter()
                get("/system_stats")
                stats_timings.append(time.perf_counter() - t0)

        poller = threading.Thread(target=poll_stats)
        poller.start()
        try:
            t0 = time.perf_counter()
            status, body = get("/ingraph/runs")
            first_s = time.perf_counter() - t0
        finally:
            listing_done.set()
            poller.join()
        t0 = time.perf_counter()
        status2, body2 = get("/ingraph/runs")
        second_s = time.perf_counter() - t0
        print(f"\nlisting {PLANTED_RUNS} runs x {PLANTED_EVENTS} events: first {first_s:.2f} s, second "
              f"{second_s * 1000:.1f} ms; /system_stats during the first: {len(stats_timings)} calls, "
              f"p95 {p95(stats_timings) * 1000:.1f} ms, max {max(stats_timings) * 1000:.1f} ms")
        assert status == status2 == 200
        for answer in (body, body2):
            runs = {r["id"]: r for r in json.loads(answer)["runs"]}
            assert {name: runs[name]["step"] for name in expected} == expected
            assert all(runs[name]["events"] == PLANTED_EVENTS for name in expected if name != broken.name)
            assert runs[broken.name]["events"] == PLANTED_EVENTS + 1  # the malformed JSON line is skipped
        assert len(stats_timings) >= 40 and p95(stats_timings) < 0.2  # enough calls for a 95th percentile
        assert second_s < max(0.5, first_s / 5)
        with pytest.raises(urllib.error.HTTPError) as info:
            get(f"/ingraph/runs/{broken.name}/samples/leak.png")
        assert info.value.code == 404
        status, page = get(f"/ingraph/runs/{broken.name}/events?since=19990&limit=5")
        page = json.loads(page)
        assert [e.get("step") for e in page["events"]] == [19990, 19991, 19992, 19993, 19994]
        assert page["next"] == 19995 and page["total"] == PLANTED_EVENTS + 1
    finally:
        for name in expected:
            shutil.rmtree(root / name, ignore_errors=True)
