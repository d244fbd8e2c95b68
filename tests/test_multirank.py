"""Real ranks under mpirun (MPI controller) and horovodrun --gloo (Gloo controller), 2 and 4 of them (Gloo on 4
ranks only where there is a core per rank: LAYOUTS).

The scenarios themselves live in tests/ranks.py and assert inside every rank. A scenario that runs many methods
(tests/cases.py) is one launch per controller and rank count, and each of its cases is a test of its own here, read
from that launch's output: one method failing does not hide the others. Scenarios share launches too (LAUNCHES), each
reported by a test of its own.

With ``HVDCOMP_TEST_DEVICE=cuda`` the scenarios run on each rank's GPU (tests/ranks.py's DEVICE), and those that run
on CPU tensors only (tests/cases.py's CPU_ONLY_SCENARIOS) and hvdcomp train's own runs are skipped, with the reason.
Several ranks share one GPU only through a Horovod built without GPU operations, which stages CUDA tensors through
host memory (launch/setup.sh's HVDCOMP_HOROVOD_GPU_OPS=none; perf/gpu/gpu_multirank.sh): NCCL's own collectives
refuse two ranks on one GPU and need a GPU per rank.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from cases import CASES, CPU_ONLY_SCENARIOS, TEST_DEVICE
from conftest import BIN, CONTROLLERS, REPO, Ranks, run_ranks

pytestmark = pytest.mark.multirank
if TEST_DEVICE == "cuda":
    import horovod.torch as hvd

    if not torch.cuda.is_available():
        raise RuntimeError("HVDCOMP_TEST_DEVICE=cuda, but torch sees no CUDA device")
    if hvd.nccl_built() and torch.cuda.device_count() < 2:
        raise RuntimeError("HVDCOMP_TEST_DEVICE=cuda on one GPU with a Horovod built with NCCL, which refuses two "
                           "ranks on one GPU: use a Horovod built without GPU operations "
                           "(HVDCOMP_HOROVOD_GPU_OPS=none launch/setup.sh, in .venv-staged; perf/gpu/gpu_multirank.sh)")


def cpu_only(reason: str) -> pytest.MarkDecorator:
    """Skips a test when the scenarios run on CUDA tensors (HVDCOMP_TEST_DEVICE=cuda), saying why."""
    return pytest.mark.skipif(TEST_DEVICE != "cpu", reason=f"on CPU tensors only: {reason}")


#: hvdcomp train's own runs (digits, bag of words) choose their device themselves (--device auto) and take minutes
TRAIN_RUNS = "hvdcomp train's runs, minutes each; the CUDA runs are tests/ranks.py's scenarios"

SCENARIOS = ["requests", "plans", "stock", "nograd", "majority", "gravac", "sketch", "lgc", "auto_local"]
#: the scenarios that share a launch per controller and rank count, in turn: those that compare runs bit for bit run
#: without tensor fusion (tests/ranks.py's RUN_TO_RUN_EXACT), apart from the others
LAUNCHES = (("requests", "plans", "nograd", "majority", "gravac", "auto_local", "buckets", "train", "collectives"),
            ("stock", "sketch", "lgc", "resume"),
            ("nonfinite_raise", "mismatch", "nonfinite_skip", "powersgd_reference"))
_launches: dict[tuple[tuple[str, ...], str, int], Ranks] = {}
#: the controllers and rank counts the scenarios launch under. Gloo's collectives with more ranks than cores take
#: about 8 ms each (4 ranks on 2 cores; MPI's 1 ms: perf/training/wait.py), which doubled the time of the scenarios'
#: 4-rank launches: there Gloo runs them on 2 ranks, and MPI on 4 (hvdcomp has no path of its own per controller;
#: test_process_sets still starts 4 ranks under Gloo).
LAYOUTS = [pytest.param(controller, np, marks=pytest.mark.skipif(
    controller == "gloo" and np > max(2, len(os.sched_getaffinity(0))),
    reason=f"Gloo on {np} ranks over fewer cores: MPI runs the scenarios on {np} ranks, Gloo on 2"))
    for controller in CONTROLLERS for np in (2, 4)]


def launched(scenario: str, controller: str, np: int, timeout: float = 540) -> Ranks:
    """The output of the launch that runs ``scenario`` (with the others of its LAUNCHES group, or alone) on ``np``
    ranks under ``controller``, launched once and shared by the tests of its scenarios and their cases. 540 s: under
    pytest's 600, so that a hang is reported with the launch's output."""
    group = next((names for names in LAUNCHES if scenario in names), (scenario,))
    if TEST_DEVICE != "cpu":  # on CUDA tensors, the group's scenarios that run on CPU tensors only are left out
        group = tuple(name for name in group if name not in CPU_ONLY_SCENARIOS)
    key = (group, controller, np)
    if key not in _launches:
        _launches[key] = run_ranks([str(REPO / "tests" / "ranks.py"), *group], np, controller, timeout)
    return _launches[key]


def assert_passed(result: Ranks, what: str, np: int) -> None:
    """Every rank ran ``what`` (a scenario, or "SCENARIO LABEL": one of its cases) and its checks passed
    (tests/ranks.py's ``case``)."""
    failed = re.findall(rf"^{re.escape(what)} FAILED rank \d+: .*$", result.output, re.MULTILINE)
    assert not failed, "\n".join(failed)
    assert result.ranks_saying(f"{what} OK") == set(range(np)), \
        f"exit status {result.returncode}\n{result.output[-5000:]}"


#: scenario -> what each rank prints, as "<scenario>: <what> (on every rank) rank R", once it caught the expected error
EXPECTED_FAILURES = {
    "nonfinite_raise": "raised FloatingPointError",
    "mismatch": "raised ValueError",
}


@pytest.mark.parametrize(("controller", "np"), LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario: str, controller: str, np: int) -> None:
    """A scenario of tests/ranks.py passed on every rank (it shares its launch with the others of its LAUNCHES)."""
    result = launched(scenario, controller, np)
    if scenario == "lgc":  # a layer too small for the encoder is kept dense, with a line that says why
        assert "parameter '4.weight' stays dense: lgc: a tensor of shape (10, 64) has 32 top-k values" \
            in result.output, result.output[-5000:]
    assert_passed(result, scenario, np)


@pytest.mark.parametrize(("controller", "np"), LAYOUTS)
@pytest.mark.parametrize(("scenario", "label"), [(scenario, label) for scenario, labels in CASES.items()
                                                 if scenario != "digits" for label in labels])
def test_case(scenario: str, label: str, controller: str, np: int) -> None:
    """One method (or reduction) of a scenario that runs them all: ``collectives`` (each default reduction against
    the sum of every rank's payloads), ``train`` (replicas bitwise identical after training), ``resume`` (a run
    resumed from a checkpoint equals the uninterrupted one)."""
    assert_passed(launched(scenario, controller, np), f"{scenario} {label}", np)


def test_cpu_only_scenarios_are_scenarios() -> None:
    """tests/cases.py's CPU_ONLY_SCENARIOS name scenarios of tests/ranks.py, none that this module runs on CUDA."""
    defined = set(re.findall(r"^def scenario_(\w+)\(", (REPO / "tests" / "ranks.py").read_text(), re.MULTILINE))
    assert set(CPU_ONLY_SCENARIOS) <= defined, set(CPU_ONLY_SCENARIOS) - defined
    on_cuda = {*SCENARIOS, *CASES, "process_sets", "nonfinite_raise", "nonfinite_skip", "mismatch"} - {"digits"}
    assert not on_cuda & set(CPU_ONLY_SCENARIOS), on_cuda & set(CPU_ONLY_SCENARIOS)


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_process_sets(controller: str) -> None:
    result = run_ranks([str(REPO / "tests" / "ranks.py"), "process_sets"], 4, controller)
    assert result.returncode == 0, result.output[-5000:]
    assert result.ranks_saying("process_sets OK") == set(range(4)), result.output[-5000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("scenario", [*EXPECTED_FAILURES, "nonfinite_skip"])
def test_bad_input_fails_cleanly_on_every_rank(scenario: str, controller: str) -> None:
    """Each catches the error it expects on every rank (they share a launch: tests/ranks.py's scenarios print what
    each caught, which this test reads back)."""
    np = 2
    result = launched(scenario, controller, np, timeout=180)
    assert_passed(result, scenario, np)
    if scenario in EXPECTED_FAILURES:
        assert result.ranks_saying(f"{scenario}: {EXPECTED_FAILURES[scenario]} (on every rank)") == set(range(np)), \
            result.output[-5000:]


@cpu_only(CPU_ONLY_SCENARIOS["raises"])
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_rank_that_raises_ends_the_job_with_its_error(controller: str) -> None:
    start = time.monotonic()
    result = run_ranks([str(REPO / "tests" / "ranks.py"), "raises"], 2, controller, timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60, result.output[-3000:]
    assert "ValueError: rank 1's data loader failed in step 3" in result.output, result.output[-3000:]


@cpu_only(CPU_ONLY_SCENARIOS["stall"])
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_stalled_rank_ends_the_job_at_the_deadline(controller: str) -> None:
    """Rank 1 sleeps 300 s; with a short deadline rank 0 names the collective it waited for, finds rank 1 alive
    (stalled, not lost: its beacon answers), and the job ends."""
    start = time.monotonic()
    result = run_ranks([str(REPO / "tests" / "ranks.py"), "stall"], 2, controller, timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60, result.output[-3000:]
    assert re.search(r"hvdcomp: rank 0 on \S+ waited \d+\.\d s for collective 'hvdcomp\.[^']+' in step 3 \(every "
                     r"rank was last heard from together in step 2, [\d.]+ s ago; ranks this rank cannot reach "
                     r"now: none; reachable: 1\)", result.output), result.output[-3000:]


@cpu_only(CPU_ONLY_SCENARIOS["auto_stall"])
@pytest.mark.parametrize(("scenario", "collective"), [("auto_stall", "agree.max"),
                                                     ("auto_stall_probe", "probe.barrier")])
def test_a_rank_stalled_while_auto_measures_ends_the_job_at_the_deadline(scenario: str, collective: str) -> None:
    """Rank 1 sleeps 300 s while auto measures (tests/ranks.py): where it ends a plan's measurement (auto_stall)
    or between the probe's round and its collectives (auto_stall_probe). Rank 0 names the collective it waited
    for, and the job ends."""
    start = time.monotonic()
    result = run_ranks([str(REPO / "tests" / "ranks.py"), scenario], 2, timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60, result.output[-3000:]
    waited = rf"hvdcomp: rank 0 on \S+ waited \d+\.\d s for collective 'hvdcomp\.auto\.{re.escape(collective)}' "
    assert re.search(waited + r"in step \d+ ", result.output), result.output[-3000:]


@cpu_only(CPU_ONLY_SCENARIOS["powersgd_reference"])
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_powersgd_matches_pytorch_hook(controller: str) -> None:
    assert_passed(launched("powersgd_reference", controller, 2, timeout=180), "powersgd_reference", 2)


@cpu_only(TRAIN_RUNS)
def test_terngrad_digits_within_one_point_of_dense(tmp_path) -> None:
    summary = tmp_path / "summary.json"
    result = run_ranks([str(BIN / "hvdcomp"), "train", "--workload", "digits", "--compression", "terngrad",
                        "--compare", "dense", "--seed", "0", "--no-progress", "--json", str(summary), "--target",
                        "0.95"], 2)
    assert result.returncode == 0, result.output[-5000:]
    dense, terngrad = json.loads(summary.read_text())
    for run in (dense, terngrad):  # evaluated after every epoch: the first epoch at 95%, and the time to it
        assert run["target_accuracy"] == 0.95 and 1 <= run["target_epoch"] <= 20 and run["time_to_target_s"] > 0
    assert "time to 95%" in result.output and result.output.count(" (ep. ") == 2, result.output[-3000:]
    assert dense["method"] == "none" and terngrad["method"] == "terngrad"
    assert dense["test_accuracy"] > 0.9, dense
    assert abs(terngrad["test_accuracy"] - dense["test_accuracy"]) <= 0.01, (dense, terngrad)
    assert terngrad["compression_ratio"] > 10, terngrad
    assert "speedup over dense" in result.output


@cpu_only(TRAIN_RUNS)
def test_sketch_trains_the_sparse_workload_as_dense_does(tmp_path) -> None:
    """``hvdcomp train --workload bow --compression sketch``: natively sparse gradients, summed losslessly, train
    the bag-of-words classifier to dense's accuracy with far fewer bytes."""
    summary = tmp_path / "summary.json"
    result = run_ranks([str(BIN / "hvdcomp"), "train", "--workload", "bow", "--compression", "sketch", "--epochs", "2",
                        "--compare", "dense", "--seed", "0", "--no-progress", "--json", str(summary)], 2)
    assert result.returncode == 0, result.output[-5000:]
    dense, sketched = json.loads(summary.read_text())
    assert dense["test_accuracy"] > 0.85, dense
    assert abs(sketched["test_accuracy"] - dense["test_accuracy"]) <= 0.005, (dense, sketched)
    assert sketched["compression_ratio"] > 20, sketched


@cpu_only(CPU_ONLY_SCENARIOS["digits"])
@pytest.mark.parametrize("method", CASES["digits"])
def test_quantizers_and_sparsifiers_train_digits_within_one_point_of_dense(method: str) -> None:
    """Each quantizer and sparsifier at its defaults trains the digits classifier to within a point of dense (the
    mean over 2 seeds; tests/ranks.py's ``digits``), and PowerSGD and random-k train it, in one launch for all."""
    assert_passed(launched("digits", "mpi", 2, timeout=540), f"digits {method}", 2)  # under pytest's 600 s


@cpu_only(TRAIN_RUNS)
def test_train_with_job_file_under_gloo(tmp_path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("workload: digits\nepochs: 2\nbatch_size: 16\nlr: 0.05\nseed: 3\n"
                   "compression:\n  method: topk\n  options: {ratio: 0.05}\n  dense: ['4.*']\n")
    summary = tmp_path / "summary.json"
    result = run_ranks([str(BIN / "hvdcomp"), "train", "--config", str(job), "--no-progress", "--json",
                        str(summary)], 2, "gloo")
    assert result.returncode == 0, result.output[-5000:]
    (run,) = json.loads(summary.read_text())
    assert run["method"] == "topk" and run["epochs"] == 2 and run["ranks"] == 2
    assert run["compression_ratio"] > 5, run
