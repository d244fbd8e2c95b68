"""The hvdcomp command line: bench compress, and bad input to train (no ranks needed to fail)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import BIN

from hvdcomp import METHODS


def hvdcomp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "hvdcomp"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("method", "max_bits"), [("terngrad", 2.05), ("fp16", 16.0), ("topk", 0.65)])
def test_bench_compress_json(method: str, max_bits: float) -> None:
    result = hvdcomp("bench", "compress", "--method", method, "--numel", "200000", "--repeats", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["method"] == method and report["numel"] == 200000
    assert 0 < report["bits_per_element"] <= max_bits, report
    for key in ("compress_gbps", "decompress_gbps", "copy_gbps", "copy_into_gbps", "fraction_of_copy"):
        assert report[key] > 0, key
    assert 0 <= report["relative_error"] < 1.5


def test_bench_rejects_unknown_option() -> None:
    result = hvdcomp("bench", "compress", "--method", "topk", "--option", "ratioo=0.1", "--json")
    assert result.returncode == 2
    assert "unknown option for topk 'ratioo'; valid: ratio" in result.stderr


def test_bench_checks_every_method_before_timing_any(capsys: pytest.CaptureFixture[str]) -> None:
    from hvdcomp import cli

    assert cli.main(["bench", "compress", "--method", "topk", "--method", "qsgd", "--option", "ratio=0.1",
                     "--json"]) == 2
    out, err = capsys.readouterr()
    assert "unknown option for qsgd 'ratio'" in err and out == "", (out, err)


def test_bench_says_where_training_would_leave_the_tensor_dense(capsys: pytest.CaptureFixture[str]) -> None:
    from hvdcomp import cli

    assert cli.main(["bench", "compress", "--method", "powersgd", "--numel", "10007", "--repeats", "1",
                     "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["compresses"] is False
    assert "powersgd would leave a tensor of shape (1, 10007) dense in training" in err


def test_train_rejects_unknown_method_with_valid_list() -> None:
    result = hvdcomp("train", "--compression", "ternary")
    assert result.returncode == 2
    assert f"unknown compression method 'ternary'; valid: {', '.join(sorted(METHODS))}" in result.stderr


def test_train_rejects_bad_job_file(tmp_path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("workload: digits\nepoch: 3\n")
    result = hvdcomp("train", "--config", str(job))
    assert result.returncode == 2
    assert "unknown key 'epoch'; valid: workload, epochs" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    # a host that joins an elastic job starts its main from the top: under --compare, in the dense run, while the
    # others run the compressed one
    (["--compare", "dense", "--elastic"], "--compare runs two jobs one after the other"),
    (["--json", "/no/such/folder/summary.json"], "--json /no/such/folder/summary.json: its folder does not exist"),
])
def test_train_refuses_before_any_rank_starts(args: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hvdcomp.tools import train

    with pytest.raises(SystemExit) as exit_:
        train.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("text", "message"), [
    ("lr: 1e-2", "lr must be a positive number (YAML reads 1e-2 as text: write 1.0e-2); got '1e-2'"),
    ("lr: -0.1", "lr must be a positive number; got -0.1"),
    ("epochs: 2.5", "epochs must be a positive integer; got 2.5"),
    ("batch_size: 0", "batch_size must be a positive integer; got 0"),
    ("seed: x", "seed must be a non-negative integer; got 'x'"),
])
def test_job_file_values_are_checked(tmp_path, text: str, message: str) -> None:
    """What `hvdcomp train --config` refuses before any rank starts (as the key above, with status 2)."""
    from hvdcomp.tools.train import load_job

    job = tmp_path / "job.yaml"
    job.write_text(f"workload: digits\n{text}\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_job(str(job))


def test_train_on_one_rank_reduces_nothing(tmp_path) -> None:
    """One rank (no launcher): nothing is reduced, as in Horovod, so no compression ratio; DGC, whose parameters
    get momentum 0 only where DGC runs, trains with SGD's momentum."""
    summary = tmp_path / "summary.json"
    result = hvdcomp("train", "--workload", "digits", "--compression", "dgc", "--epochs", "1", "--no-progress",
                     "--compare", "dense", "--json", str(summary))
    assert result.returncode == 0, result.stderr[-3000:]
    dense, run = json.loads(summary.read_text())
    assert run["ranks"] == 1 and run["compression_ratio"] is None and run["trace"] is None, run
    assert dense["method"] == "none" and "speedup over dense:" in result.stdout
    assert "fewer bytes" not in result.stdout


def test_help_lists_commands() -> None:
    result = hvdcomp("--help")
    assert result.returncode == 0 and "train" in result.stdout and "bench" in result.stdout
