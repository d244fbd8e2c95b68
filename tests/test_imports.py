"""What imports Horovod: the compressors, requests, kernels, configuration, deadlines, ``hvdcomp bench compress`` and
``hvdcomp profile`` do not (a GPU machine benchmarks them without Horovod built); the optimizer and the collectives
do. The extras' packages are imported only by the tools that need them, which name the extra when it is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

import hvdcomp

WITHOUT_HOROVOD = """
import importlib.abc, sys

class NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, NoHorovod())

import contextlib, io
import torch
import hvdcomp, hvdcomp.methods, hvdcomp.kernels, hvdcomp.config, hvdcomp.tools.bench, hvdcomp.perfmodel.profile
from hvdcomp import Context, make_compressor
from hvdcomp.deadlines import DEFAULT_DEADLINE, Deadline
from hvdcomp.requests import Allreduce

grad = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
for method, options in [("terngrad", {}), ("qsgd", {}), ("topk", {"ratio": 0.05}), ("powersgd", {"start_iter": 0})]:
    compressor = make_compressor(method, options)
    ctx = Context.local(grad, seed=3)
    state = compressor.init_state(grad, ctx)
    payload, meta = compressor.compress(grad, state, ctx)
    decoded = compressor.decompress(payload, meta).float()
    assert decoded.shape == grad.shape and bool(decoded.isfinite().all()), method
    assert float((decoded - grad).norm() / grad.norm()) < 2, method

Allreduce([torch.ones(2)], "max")
try:
    Allreduce([torch.ones(2)], "mean")
except ValueError:
    pass
else:
    raise AssertionError("Allreduce accepted op 'mean'")

assert hvdcomp.Deadline is Deadline and DEFAULT_DEADLINE.seconds(None) == 120 and Deadline().seconds(4.0) == 40
assert DEFAULT_DEADLINE.seconds(0.05) == 30  # its floor: a lost link in fast steps ends the job 30 s later

out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert hvdcomp.tools.bench.main(["compress", "--method", "terngrad", "--numel", "4096", "--repeats", "1",
                                     "--json"]) == 0
assert '"bits_per_element"' in out.getvalue(), out.getvalue()

assert "horovod" not in sys.modules, sorted(name for name in sys.modules if name.startswith("horovod"))
try:
    hvdcomp.DistributedOptimizer
except ImportError:
    pass
else:
    raise AssertionError("hvdcomp.DistributedOptimizer resolved with Horovod hidden")
print("WITHOUT HOROVOD OK")
"""


def test_compressors_kernels_config_and_bench_import_without_horovod() -> None:
    """With every ``horovod`` module made to raise ImportError: the package, the methods, the kernels, the
    configuration and the benchmark import, compressors compress and decompress on the CPU, requests validate,
    deadlines are built, and Horovod is imported by nothing; the optimizer, which needs it, fails only when it is
    asked for."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_HOROVOD], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "WITHOUT HOROVOD OK" in done.stdout, done.stdout + done.stderr


def test_horovod_names_resolve_lazily() -> None:
    """The names that need Horovod still resolve on the package (first use imports them), are listed by ``dir``,
    and the ops requests accept are the ones the collectives map to Horovod's."""
    pytest.importorskip("horovod.torch")
    from hvdcomp import collectives, distributed, requests

    assert hvdcomp.DistributedOptimizer is distributed.DistributedOptimizer
    assert set(hvdcomp.__all__) <= set(dir(hvdcomp))
    assert all(hasattr(hvdcomp, name) for name in hvdcomp.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        hvdcomp.Missing  # noqa: B018
    assert tuple(collectives.OPS) == requests.ALLREDUCE_OPS
    # a fresh interpreter (here hvdcomp.elastic may be imported already, which binds it on the package)
    done = subprocess.run([sys.executable, "-c", "import hvdcomp; print(hvdcomp.elastic.TorchState.__name__)"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "TorchState", done.stdout + done.stderr


WITHOUT_EXTRAS = """
import importlib.abc, sys

import torch  # before the finder: torch itself looks for pynvml on import

EXTRAS = ("sklearn", "jsonschema", "kubernetes_validate", "matplotlib", "mpi4py", "pynvml")
asked = []

class NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in EXTRAS:
            asked.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, NoExtras())
sys.modules.pop("pynvml", None)  # imported by torch where it is installed

import contextlib, io, os, tempfile
import hvdcomp, hvdcomp.cli, hvdcomp.k8s.cli, hvdcomp.tools.train, hvdcomp.tools.bench
import hvdcomp.perfmodel.predict, hvdcomp.perfmodel.profile
from hvdcomp.extras import MissingExtra
from hvdcomp.perfmodel import probe
from hvdcomp import workloads

hvdcomp.DistributedOptimizer
assert not asked, f"the package, the optimizer or the commands' modules asked for {asked}"

def fails(extra, feature, run):
    try:
        run()
    except MissingExtra as error:
        assert feature in str(error) and f"pip install 'hvdcomp[{extra}]'" in str(error), error
    else:
        raise AssertionError(f"{feature} ran without its extra")

def command(*argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = hvdcomp.cli.main(list(argv))
    return status, err.getvalue()

fails("digits", "the digits workload", lambda: workloads.digits(0))
fails("perf", "hvdcomp predict --plot", lambda: hvdcomp.perfmodel.predict.plot(None, "scaling.png"))
with tempfile.TemporaryDirectory() as tmp:
    job = os.path.join(tmp, "job.k8s.yaml")
    status, err = command("k8s", "render", "--config", "k8s/overlays/cpu-smoke/job.yaml", "-o", job)
    assert status == 0, err
    status, err = command("k8s", "validate", job)
    assert status == 2 and "hvdcomp k8s validate" in err and "pip install 'hvdcomp[k8s]'" in err, err
    os.environ["OMPI_COMM_WORLD_SIZE"] = "2"
    status, err = command("probe", "--out", os.path.join(tmp, "cluster.yaml"))
    assert status == 2 and "pip install 'hvdcomp[perf]'" in err, err
assert "pip install 'hvdcomp[perf]'" in probe.gpus()[1]
print("WITHOUT EXTRAS OK")
"""


def test_the_optimizer_needs_no_extra_and_the_tools_name_theirs() -> None:
    """With the extras' packages made to raise ImportError: the package, the optimizer and the commands' modules
    import without asking for them, and each tool that needs one says which: the digits workload, ``predict --plot``,
    ``k8s validate`` (while ``k8s render`` works), ``probe`` under mpirun, probe's GPU section."""
    pytest.importorskip("horovod.torch")
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "WITHOUT EXTRAS OK" in done.stdout, done.stdout + done.stderr
