"""A pytest plugin that writes each failing test's report to the file ``$REPORT_FAILURES`` as soon as it fails.

    REPORT_FAILURES=OUT/failures.txt PYTHONPATH=perf/gpu python -m pytest -p report_failures -n 8 ...

Under pytest-xdist the failures' messages are printed only when the session ends; a stage cut off at its time limit
(perf/gpu/gpu_kernels.sh) would lose them, as two H100 runs did.
"""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # under xdist each report reaches both its worker and the controller: the controller writes it
    if report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(os.environ["REPORT_FAILURES"], "a") as out:
            out.write(f"{report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
