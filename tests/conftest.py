"""Shared helpers: start real Horovod ranks with mpirun (MPI controller) or horovodrun --gloo (Gloo); run a test
on a method's fused CPU kernels and on its pure-PyTorch path; a gradient at float32's largest magnitudes, one with
NaN and infinite entries, and nearly rank-deficient matrices."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hvdcomp.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONTROLLERS = ("mpi", "gloo")


@pytest.fixture(params=["kernels", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on the fused CPU kernels and on the pure-PyTorch path (the one taken where no kernel applies),
    by turning the kernels off (``HVDCOMP_KERNELS=0``)."""
    if request.param == "kernels":
        assert cpu_kernels() is not None, "the fused CPU kernels did not build"
    else:
        monkeypatch.setenv("HVDCOMP_KERNELS", "0")
    return request.param


def huge_gradient() -> torch.Tensor:
    """4,096 Gaussian entries in buckets of 512 at magnitudes up to 1e38 (where float32 sums of a bucket overflow, from
    about 1e36; a sum over 2 ranks does not), 1e20 (float32 squares overflow), 1 and 1e-20."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).double()
    for bucket, top in enumerate((1e38, 1e36, 1e20, 1.0, 1e-20, 1.0, 3e37, 1.0)):
        part = x[512 * bucket:512 * (bucket + 1)]
        part *= top / part.abs().max()
    return x.float()


def nonfinite_buckets() -> torch.Tensor:
    """Six buckets of 8 multiples of 1/8: with a NaN, +Inf, -Inf, both infinities, all NaN, and none."""
    base = torch.arange(-3, 5).float() / 8
    buckets = []
    for bad in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")], [float("nan")] * 8, []):
        bucket = base.clone()
        bucket[:len(bad)] = torch.tensor(bad)
        buckets.append(bucket)
    return torch.cat(buckets)


def nearly_parallel(batch: int = 50, rows: int = 300) -> torch.Tensor:
    """P = M Q of rank-1 Ms (u v^T, plus noise 1e-6 of it in half of them): a batch of n x 2 matrices whose second
    column is the first's multiple to float32 rounding (or to the noise), as PowerSGD meets where a gradient's rank,
    summed over the ranks, is below its own."""
    generator = torch.Generator().manual_seed(5)
    u = torch.randn(batch, rows, 1, generator=generator)
    noise = torch.randn(batch, rows, 2, generator=generator) * 1e-6 * (torch.arange(batch) % 2).view(-1, 1, 1)
    return u @ torch.randn(batch, 1, 2, generator=generator) + noise * u.abs().mean()


@dataclass
class Ranks:
    returncode: int
    output: str

    def ranks_saying(self, text: str) -> set[int]:
        """The ranks that printed ``<text> rank R`` (output of several ranks can interleave mid-line)."""
        return {int(rank) for rank in re.findall(rf"{re.escape(text)} rank (\d+)", self.output)}


def run_ranks(args: list[str], np: int, controller: str = "mpi", timeout: float = 300) -> Ranks:
    """Runs ``python ARGS`` (or a console script) on ``np`` ranks; a hang fails after ``timeout`` seconds."""
    if controller == "mpi":
        launcher = [str(REPO / "launch" / "mpirun.sh"), "-np", str(np)]
    elif controller == "gloo":
        launcher = [str(BIN / "horovodrun"), "--gloo", "-np", str(np), "-H", f"localhost:{np}"]
    else:
        raise ValueError(f"unknown controller {controller!r}; valid: {CONTROLLERS}")
    command = args if args[0].startswith(str(BIN)) else [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*launcher, *command], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank it started
        output, _ = process.communicate()
        raise AssertionError(f"ranks did not finish within {timeout} s (hang?):\n{output[-5000:]}") from None
    return Ranks(process.returncode, output)
