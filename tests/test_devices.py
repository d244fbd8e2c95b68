"""Every method on every device this machine has: CUDA against the CPU reference, determinism, and no host
syncs in what runs inside backward hooks; every default reduction on one rank (NCCL on CUDA tensors).

CI has no GPU, so there the CUDA cases skip and the CPU cases run; ``perf/gpu/gpu_check.sh`` runs this file on a
GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import REPO

from hvdcomp import METHODS, Context, make_compressor

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
#: every shipped method with options that make it compress a 96 x 64 gradient
CASES = {"fp16": {}, "terngrad": {}, "topk": {"ratio": 0.05}, "randomk": {"ratio": 0.05, "unbiased": True},
         "powersgd": {"start_iter": 0}, "bingrad": {}, "onebit": {}, "orq": {}, "qsgd": {}, "signsgd": {},
         "efsignsgd": {}, "threshold": {"density": 0.05}, "dgc": {"density": 0.05}, "gravac": {}, "sketch": {},
         "lgc": {"ratio": 0.05, "dense_steps": 0, "train_steps": 1, "max_error": 100.0}}
#: methods whose CUDA and CPU paths compute the same function (no random draw): the same values
SAME_FUNCTION = ("fp16", "topk", "powersgd", "bingrad", "onebit", "efsignsgd", "signsgd", "dgc", "gravac",
                 "sketch")
#: methods that find what they send on the host after the step's vote (their docstrings): only agree() runs in the
#: backward hook without a sync
AFTER_VOTE = ("sketch",)


def test_every_method_is_covered() -> None:
    assert set(CASES) == set(METHODS) - {"none"}, "a new method must be checked on every device here"


def _run(method: str, device: str, steps: int = 3) -> list[list[torch.Tensor]]:
    """Compress and decompress ``steps`` gradients of one parameter (with the method's memory), one rank."""
    compressor = make_compressor(method, CASES[method])
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(96, 64, generator=generator).to(device) for _ in range(steps)]
    ctx = Context.local(grads[0], seed=3)
    state = compressor.init_state(grads[0], ctx)
    outputs = []
    for step, grad in enumerate(grads):
        payload, meta = compressor.compress(grad, state, replace(ctx, step=step))
        outputs.append([*payload, compressor.decompress(payload, meta).float()])
    return outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(CASES))
def test_deterministic(method: str, device: str) -> None:
    """The same seeds and inputs give the same bits, run after run (replicas stay identical)."""
    for first, second in zip(_run(method, device), _run(method, device), strict=True):
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b), f"{method} on {device} is not deterministic"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("method", sorted(CASES))
def test_cuda_matches_the_cpu_reference(method: str) -> None:
    """Where both devices compute the same function (SAME_FUNCTION), the same values; where the draws come from
    different generators (TernGrad, random-k, ORQ, QSGD), what any draw must satisfy."""
    first_grad = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))  # _run's first gradient
    for step, (cpu, cuda) in enumerate(zip(_run(method, "cpu"), _run(method, "cuda"), strict=True)):
        decoded_cpu, decoded_cuda = cpu[-1], cuda[-1].cpu()
        if method in SAME_FUNCTION:
            torch.testing.assert_close(decoded_cuda, decoded_cpu, rtol=1e-4, atol=1e-5)
        elif method in ("orq", "qsgd"):  # the same levels (tables), draws from different generators
            torch.testing.assert_close(cuda[0].cpu(), cpu[0], rtol=1e-4, atol=1e-5)
            assert decoded_cuda.sub(decoded_cpu).abs().max() <= 2 * cpu[0].abs().max(), method
        elif method == "threshold":  # t is fitted by reductions whose float order differs: entries at t may differ
            differ = decoded_cuda.ne(decoded_cpu).sum().item()
            assert differ <= 2, f"threshold: {differ} entries differ between CUDA and CPU"
        elif method == "lgc":  # the same indices; the autoencoder's convolutions round differently (cuDNN, TF32)
            if step == 0:
                assert torch.equal(cuda[0].cpu(), cpu[0]), "lgc: CUDA chose other top-k indices than the CPU"
                torch.testing.assert_close(decoded_cuda, decoded_cpu, rtol=2e-2, atol=2e-3)
        elif method == "terngrad":  # values in {-s, 0, s}, s the same clipped max
            scale = cuda[0].item()
            assert set(decoded_cuda.unique().tolist()) <= {-scale, 0.0, scale}
            assert abs(scale - cpu[0].item()) <= 1e-5 * scale
        elif step == 0:  # random-k: k entries, each the gradient's times its stratum's length (19 or 20 here)
            kept = decoded_cuda.nonzero(as_tuple=True)
            assert len(kept[0]) == decoded_cpu.count_nonzero() == 308
            ratios = (decoded_cuda[kept] / first_grad[kept]).round()
            assert set(ratios.tolist()) <= {19.0, 20.0}, set(ratios.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("method", sorted(CASES))
def test_no_host_sync_in_compression(method: str) -> None:
    """compress() runs inside backward hooks: on CUDA it must not wait for the device."""
    compressor = make_compressor(method, CASES[method])
    grad = torch.randn(96, 64, device="cuda")
    ctx = Context.local(grad)
    state = compressor.init_state(grad, ctx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        request = compressor.agree(grad, state, ctx)
        if method not in AFTER_VOTE:
            compressor.compress(grad, state, ctx, None if request is None else request.values)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_on_one_rank(device: str) -> None:
    """Every default reduction and PowerSGD's, driven by run_alone through Horovod on one rank (NCCL for
    CUDA tensors): a result of the gradient's shape, on its device, finite. On CUDA, what runs in backward hooks
    (the reduction up to its first collective, started) must not synchronize with the device."""
    script = f"""
import dataclasses, torch, horovod.torch as hvd
from hvdcomp import reductions, make_compressor, Context
from hvdcomp.collectives import run_alone, start
from hvdcomp.requests import Agree
hvd.init()
cases = {{"fp16": "allreduce", "terngrad": "allgather", "topk": "allgather", "randomk": "allreduce",
         "powersgd": "powersgd", "bingrad": "allgather", "onebit": "allgather", "orq": "allgather",
         "qsgd": "allgather", "signsgd": "allgather", "efsignsgd": "allgather", "threshold": "allgather",
         "dgc": "allgather", "gravac": "gravac", "sketch": "sketch", "lgc": "lgc"}}
host_decisions = ["gravac", "sketch"]  # decide from the agreed values on the host, after the vote (docstrings)
two_phase = ["terngrad", "bingrad", "onebit", "orq", "qsgd", "signsgd", "efsignsgd"]
for method, reduction_name in [*cases.items(), *((name, "two_phase") for name in two_phase)]:
    compressor = make_compressor(method, {CASES!r}[method], error_feedback=False)
    reduction = reductions.make(reduction_name, compressor)
    grad = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).to("{device}")
    if method == "sketch":  # a few rows, as an embedding's gradient: the sketch path, not its dense fallback
        grad[torch.arange(96) % 16 != 0] = 0
    ctx = Context("w", 0, 1, grad.device, 5, 7)
    state = reduction.init_state(grad, ctx)
    # What runs in backward hooks: the reduction up to its first collective, started (on CUDA: no syncs).
    generator = reduction.reduce(grad, state, ctx)
    if grad.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        request = next(generator)
        while isinstance(request, Agree) and method not in host_decisions:  # one rank: its own values agreed
            request = generator.send(request.values)
        if not isinstance(request, Agree):
            pending = start(request, method + reduction_name + ".hook")
    finally:
        if grad.is_cuda:
            torch.cuda.set_sync_debug_mode("default")
    if isinstance(request, Agree):  # a decision on the host, after the vote
        while isinstance(request, Agree):
            request = generator.send(request.values)
        pending = start(request, method + reduction_name + ".hook")
    pending.wait()
    result = run_alone(reduction.reduce(grad, state, ctx), method + reduction_name)
    assert result.shape == grad.shape and result.device == grad.device, (method, result.shape, result.device)
    assert torch.isfinite(result).all(), method
    if method == "sketch":
        assert state["sketch"]["path"] == "sketch" and torch.equal(result, grad), state["sketch"]
    if method == "lgc":  # step 0 was stage 2 (the autoencoder trained); step 1 enters stage 3 (rank 0's weights
        # first), step 2 is its steady state: up to its first collective, no sync with the device on CUDA either
        run_alone(reduction.reduce(grad, state, dataclasses.replace(ctx, step=1)), "lgc.stage3")
        generator = reduction.reduce(grad, state, dataclasses.replace(ctx, step=2))
        if grad.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            first = next(generator)
        finally:
            if grad.is_cuda:
                torch.cuda.set_sync_debug_mode("default")

        def resumed():
            value = yield first
            while True:
                try:
                    request = generator.send(value)
                except StopIteration as done:
                    return done.value
                value = yield request

        result = run_alone(resumed(), "lgc.steady")
        assert state["last"]["stage"] == 3 and result.device == grad.device and torch.isfinite(result).all()
print("reductions OK")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "reductions OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_sketch_decodes_on_cuda_as_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors (filter and sketch built on the GPU, decoded by the host's kernels, and by the PyTorch path that
    peels in rounds on the GPU where the kernels are missing) give the CPU's candidates, verdict and, with float64
    cells, values."""
    from hvdcomp.methods import sketch

    supports = [torch.randperm(200_000, generator=torch.Generator().manual_seed(r))[:5000] for r in range(3)]
    values = [torch.randn(5000, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(3)]
    bits, hashes = sketch.filter_size(15_000, 200_000, 3, None)
    decoded = {}
    for device, path in (("cpu", "kernels"), ("cuda", "kernels"), ("cuda", "torch")):
        if path == "torch":
            monkeypatch.setattr(sketch, "cpu_kernels", lambda: None)
        union = sketch.bloom(supports[0].to(device), 3, bits, hashes)
        for support in supports[1:]:
            union |= sketch.bloom(support.to(device), 3, bits, hashes)
        found = sketch.candidates(union, 200_000, 3, hashes)
        c3 = sketch.sketch_cells(found.numel(), 1.1, 24)
        table = sum(sketch.encode(v.to(device), s.to(device), 4, c3, torch.float64)
                    for v, s in zip(values, supports, strict=True))
        result, resolved = sketch.peel(found, table, 4)
        assert found.device.type == result.device.type == device
        decoded[device, path] = (found.cpu(), result.cpu(), resolved)
    reference = decoded["cpu", "kernels"]
    for key, (found, result, resolved) in decoded.items():
        assert torch.equal(found, reference[0]) and resolved == reference[2] == found.numel(), key
        assert torch.equal(result, reference[1]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_profile_times_cuda_kernels() -> None:
    """``hvdcomp.perfmodel.profile.profile`` on the GPU: every timed region ends with a device synchronization and
    each gradient's readiness comes from a CUDA event, so the last gradient is ready within backward's time, and near
    its end: at a batch large enough for the GPU to lag the host, the host's enqueue times would come much earlier."""
    from hvdcomp.perfmodel.profile import profile
    from hvdcomp.tools.models import resnet18, resnet18_batch

    x, y = resnet18_batch(256)
    document = profile(resnet18().cuda(), (x.cuda(), y.cuda()), methods=["topk", "fp16"], repeats=3)
    assert document["device"].startswith("cuda") and set(document["compressors"]) == {"topk", "fp16"}
    ready = [g["ready_ms"] for g in document["gradients"]]
    backward = document["backward_ms"]
    assert 0 < ready[0] <= ready[-1] <= 1.1 * backward and ready[-1] >= 0.5 * backward, (ready[0], ready[-1], backward)


@pytest.mark.parametrize("device", DEVICES)
def test_auto_clock_reads_when_the_device_finished(device: str) -> None:
    """``compression: auto`` times gradients' readiness with marks read after the step (``hvdcomp.auto._Clock``): on
    CUDA an event on the gradients' device, so a mark taken while kernels are still queued reads when they finished,
    not when the host queued them; on the CPU the host clock."""
    import time

    from hvdcomp.auto import _Clock

    def work(x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = torch.tanh(x @ x)
        return x

    clock = _Clock(torch.device(device))
    # 20 products of 4096 x 4096 take tens of milliseconds even on an H200 (of 2048 x 2048, not run before, they took
    # 16 ms there and took 10 ms to queue: loading their kernels, likely); on the CPU, where only the host clock is
    # read, a small size does
    x = torch.randn((4096, 4096) if device == "cuda" else (512, 512), device=device)
    x = work(x)  # the kernels loaded before the timing
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    origin = clock.mark()
    work(x)
    mark = clock.mark()
    queued = time.perf_counter() - start
    elapsed = clock.seconds(origin, mark)  # waits for the mark on CUDA
    finished = time.perf_counter() - start
    assert 0 < elapsed <= finished * 1.05, (elapsed, finished)
    if device == "cuda":  # 20 matrix products queue in well under a millisecond and take tens of milliseconds
        assert elapsed > 2 * queued, (elapsed, queued)


#: a NaN, an Inf, a -Inf, finite values whose float32 sum would overflow, empty, half precision: the flags expected
NONFINITE_CASES = [([1.0, -2.0], torch.float32, False), ([1.0, float("nan")], torch.float32, True),
                   ([float("-inf"), 0.0], torch.float32, True), ([3e38] * 4, torch.float32, False),
                   ([], torch.float32, False), ([1.0, float("inf")], torch.bfloat16, True),
                   ([2.0, 65504.0], torch.float16, False)]


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_flags_each_tensor(device: str) -> None:
    """The optimizer's check of its gradients (hvdcomp.compressor.nonfinite; on CUDA by norms, in one launch for all
    of them): ``mark`` for each tensor with a NaN or an Inf, 0 for the others, the range of float32 no excuse; and on
    CPU tensors its CUDA branch gives the same flags."""
    from hvdcomp.compressor import _finite_by_norms, nonfinite

    tensors = [torch.tensor(values, dtype=dtype, device=device) for values, dtype, _ in NONFINITE_CASES]
    expected = [3.0 if bad else 0.0 for _, _, bad in NONFINITE_CASES]
    flags = nonfinite(tensors, mark=3)
    assert flags.dtype == torch.float32 and flags.device.type == device
    assert flags.tolist() == expected
    assert (~_finite_by_norms(tensors)).tolist() == [bad for _, _, bad in NONFINITE_CASES]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: tensors on the CPU and a GPU at once")
def test_nonfinite_flags_tensors_on_several_devices() -> None:
    """A model split across the CPU and a GPU: each device's tensors checked on it, the flags in the tensors' order
    on the first one's device (torch.stack of flags from two devices would fail every step)."""
    from hvdcomp.compressor import nonfinite

    devices = ["cuda", "cpu"] * len(NONFINITE_CASES)
    tensors = [torch.tensor(values, dtype=dtype, device=device)
               for (values, dtype, _), device in zip(NONFINITE_CASES * 2, devices, strict=True)]
    flags = nonfinite(tensors, mark=2)
    assert flags.device.type == "cuda"
    assert flags.tolist() == [2.0 if bad else 0.0 for _, _, bad in NONFINITE_CASES * 2]


def test_train_gives_each_rank_a_gpu_of_its_own_under_nccl(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``hvdcomp train --device``: where Horovod's NCCL operations would see two ranks on one GPU (the ranks' GPU
    UUIDs gathered), ``cuda`` is refused with the reason and ``auto`` trains on the CPU, on every rank; ranks that each
    see only their own GPU (device_count 1, CUDA_VISIBLE_DEVICES per rank) train on it, and a Horovod without GPU
    operations lets ranks share one. (Two ranks and their GPUs stood in for: one machine with one GPU could not show
    these with real ranks.)"""
    from types import SimpleNamespace

    pytest.importorskip("horovod.torch", reason="hvdcomp train needs Horovod (perf/gpu/gpu_kernels.sh runs this file "
                        "where it is not installed)")
    from hvdcomp.tools import train

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    for name, value in (("rank", 0), ("local_rank", 1), ("local_size", 2), ("nccl_built", 1)):
        monkeypatch.setattr(train.hvd, name, lambda value=value: value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="GPU-a"))
    others: dict[str, str | None] = {}

    def allgather_object(mine: tuple[str, str], name: str) -> list[tuple[str, str | None]]:
        assert mine[1] == "GPU-a" and name == "hvdcomp.train.gpus", (mine, name)
        assert "HOROVOD_ELASTIC" not in os.environ, "a collective outside the elastic function"
        return [mine, (mine[0], others["gpu"])]

    monkeypatch.setattr(train.hvd, "allgather_object", allgather_object)
    others["gpu"] = "GPU-a"  # both ranks on one GPU
    with pytest.raises(ValueError, match="--device cuda: 2 ranks on 1 GPU, and this Horovod's NCCL operations"):
        train.pick_device("cuda")
    assert train.pick_device("auto") == torch.device("cpu")
    assert "--device auto: 2 ranks on 1 GPU," in capsys.readouterr().err
    others["gpu"] = None  # the other rank has no CUDA: every rank trains on the CPU
    assert train.pick_device("auto") == torch.device("cpu")
    assert "torch.cuda.is_available() is False on rank 1" in capsys.readouterr().err
    others["gpu"] = "GPU-b"  # each rank sees its own GPU alone
    assert train.pick_device("auto") == train.pick_device("cuda") == torch.device("cuda", 0)
    with monkeypatch.context() as elastic:  # each rank counts alone: 2 ranks, 1 GPU seen, unless it is its own
        elastic.setenv("HOROVOD_ELASTIC", "1")
        elastic.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        assert train.pick_device("auto") == torch.device("cpu")
        elastic.setenv("CUDA_VISIBLE_DEVICES", "3")
        assert train.pick_device("auto") == torch.device("cuda", 0)
    capsys.readouterr()
    others["gpu"] = "GPU-a"
    monkeypatch.setattr(train.hvd, "nccl_built", lambda: 0)  # staged through host memory: ranks may share one
    assert train.pick_device("auto") == train.pick_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA: the CPU, unsaid
    assert train.pick_device("auto") == torch.device("cpu") and not capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--device cuda: torch\.cuda\.is_available\(\) is False on this machine"):
        train.pick_device("cuda")
