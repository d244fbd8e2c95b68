"""A pytest plugin that appends each failing test's report to the file ``$REPORT_FAILURES`` as soon as it fails.

    REPORT_FAILURES=OUT/failures.txt PYTHONPATH=perf/gpu python -m pytest -p report_failures -n 8 ...

Under pytest-xdist the failures' messages are printed only when the session ends; a stage cut off at its time limit
(perf/gpu/gpu_kernels.sh) would lose them, as two H100 runs did.
"""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # under xdist each report reaches both its worker and the controller: the controller writes it
    path = os.environ.get("REPORT_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as out:
            out.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
