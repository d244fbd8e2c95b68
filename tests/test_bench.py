"""``hvdcomp bench compress``'s clocks: the CPU path for real, the CUDA path's order of work (L2 flush, events,
one synchronize per round) with CUDA's calls replaced by recorders, so that it is checked where there is no GPU."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from hvdcomp.tools import bench


def test_flush_buffer_outsizes_l2() -> None:
    """At least do_bench's 256 MB, and at least twice the L2 cache (an H100's is 50 MB; a larger one doubles)."""
    assert bench.flush_bytes(50 * 2**20) == 256 * 2**20
    assert bench.flush_bytes(200 * 2**20) == 400 * 2**20


def test_cpu_clock_times_every_round() -> None:
    calls: list[str] = []
    timings = bench.timed({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, torch.device("cpu"), 3)
    assert calls == ["a", "b"] * 4  # one warm-up each, then 3 interleaved rounds
    for timing in timings.values():
        assert len(timing.times) == 3 and timing.times == timing.host and timing.median >= 0


class _Recorder:
    """Stands in for CUDA and the L2 flush buffer: events stamped by a counter, and a log of what was done in
    which order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.clock = 0.0

    def event(self, enable_timing: bool = False) -> Any:
        recorder = self

        class Event:
            def record(self, stream: Any = None) -> None:
                assert enable_timing and stream == "stream"
                recorder.clock += 1.0  # each event 1 ms after the one before: every call takes 1 ms
                self.at = recorder.clock
                recorder.log.append("event")

            def elapsed_time(self, end: Event) -> float:
                return end.at - self.at

        return Event()

    def zero_(self) -> None:  # the L2 flush buffer's
        self.log.append("flush")

    def synchronize(self, device: Any = None) -> None:
        self.log.append("sync")


def test_cuda_clock_flushes_l2_and_synchronizes_once_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "Event", recorder.event)
    monkeypatch.setattr(torch.cuda, "synchronize", recorder.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(bench, "_flush_buffer", lambda device: recorder)
    fns = {name: (lambda name=name: recorder.log.append(name)) for name in ("copy", "compress", "decompress")}
    timings = bench.timed(fns, torch.device("cuda"), repeats=2)
    one_call = ["flush", "event", "{}", "event"]
    round_ = [step.format(name) for name in fns for step in one_call] + ["sync"]
    assert recorder.log == ["copy", "compress", "decompress", "sync", *round_, *round_]
    for timing in timings.values():
        assert timing.times == [1e-3, 1e-3] and len(timing.host) == 2  # milliseconds read as seconds


def test_bench_compress_reports_times_and_spread() -> None:
    report = bench.bench_compress("terngrad", 1024, repeats=3)
    assert report["clock"] == "host" and report["repeats"] == 3
    for name in ("copy", "compress", "decompress"):
        spread = report["spread_us"][name]
        assert 0 < spread["min"] <= report[f"{name}_us"] <= spread["max"], name
        assert report["host_us"][name] == report[f"{name}_us"]  # on CPU the host's time is the call's
    assert report["compress_decompress_us"] == pytest.approx(report["compress_us"] + report["decompress_us"],
                                                             abs=2e-3)
    assert report["compress_gbps"] == pytest.approx(1024 * 4 / 1e3 / report["compress_us"], rel=1e-3)


def test_command_runs_every_method_at_every_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["compress", "--method", "signsgd", "--method", "fp16", "--numel", "1024", "--numel", "3000",
                       "--repeats", "1", "--json"]) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["method"], r["numel"]) for r in reports] == [("signsgd", 1024), ("signsgd", 3000), ("fp16", 1024),
                                                           ("fp16", 3000)]
    assert all(r["compress_us"] > 0 and r["decompress_us"] > 0 for r in reports)
