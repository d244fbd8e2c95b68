"""LGC: learned gradient compression (Abrahamyan, Chen, Bekoulis and Deligiannis, "Learned Gradient Compression for
Distributed Deep Learning", IEEE TNNLS 2021, arXiv:2103.08870).

The gradients of different ranks share a common part. A small autoencoder, trained online during training, learns
it, so that each rank sends a short code (or a small innovation) where top-k would send every value. Training goes
through three stages, switched from the step counter (and by the guard, below), so every rank switches in the same
step:

1. ``dense_steps`` steps of dense allreduce.
2. ``train_steps`` steps of top-k with error feedback while the autoencoder trains. The top-k indices I are those of
   one *leader* rank's error-compensated gradient (cyclic local top-k, ScaleCom's scheme, which the third-party LGC
   port uses too), broadcast with the leader's scale s = RMS(p_leader[I]); every rank sends its values v_r = p_r[I]
   (allgather), the sum is exact, and e_r[I] <- 0. Every rank then holds every rank's v_r / s, the autoencoder's
   training batch: exactly what stage 3 encodes.
3. Compressed through the autoencoder (E the encoder, D the decoder), from the same leader's I and s:

   * ``variant: ring`` (ring-allreduce, Horovod's own protocol): each rank sends its code c_r = E(v_r / s); the codes
     are summed by allreduce and the summed code decoded, v_hat = s D(sum_r c_r / N), an estimate of the mean of the
     v_r; the sum returned is N v_hat at I.
   * ``variant: ps`` (parameter server; here every rank is the server): the leader broadcasts its code
     c_l = E(v_l / s) with I and s; every rank sends only its innovation u_r, its own top-k' of v_r / s (k' =
     ``innovation_ratio`` k, values and positions in I, allgather); rank r's own decoder reconstructs its values,
     v_hat_r = s D_r(c_l, u_r), and the sum returned is sum_r v_hat_r at I.

   Error feedback keeps what the autoencoder got wrong: e_r[I] <- p_r[I] - v_hat (ring) or p_r[I] - v_hat_r (ps).

The leader rotates, l = step mod N. With a fixed leader the entries only other ranks find large would wait in their
residuals until the leader's gradient happens to select them; rotating gives each rank's largest entries a turn
every N steps, and spreads the leader's broadcast over every rank's link.

The autoencoder (one per compressed tensor, or per bucket with the config's ``bucket_cap_mb``, where the top-k too is
the bucket's; the paper's is one per model) is a few stride-2 1-D convolutions (kernel 4) with LeakyReLU between them,
from 1 to ``channels`` channels and down to ``code_channels`` at 1 / 2^``downsample`` of the length: the code has
code_channels / 2^downsample of the k values (1/8 at the defaults). The decoders are transposed convolutions back; the
ps decoders (one per rank, as in the paper) end in a 1x1 convolution over their features and the rank's innovation, and
keep the innovation's values where the rank sent them. The weights live in the parameter's state (checkpointed with it)
and are drawn from the parameter's shared seed, so they start identical on every rank. Training, one Adam step (``lr``)
per stage-2 step on the gathered batch, minimizes the reconstruction error plus the term that pulls the ranks' codes
together (weight ``similarity``), mean squared errors over the k values:

    ring:  MSE(D(mean_r E(x_r)), mean_r x_r) + similarity * mean_r MSE(E(x_r), mean_q E(x_q))
    ps:    mean_r MSE(D_r(E(x_l), u_r), x_r) + similarity * mean_r MSE(E(x_r), mean_q E(x_q))

with x_r = v_r / s. Every rank trains on the same batch with the same arithmetic, so the copies stay equal without
communication; at each entry into stage 3 rank 0 broadcasts its weights anyway (a few thousand values, once), so that
every rank decodes with the same weights even where training rounded differently. The autoencoder is frozen in stage
3. Its convolutions run with cuDNN's deterministic algorithms (no benchmark mode, whatever the job sets), so ranks of
the same kind decode to the same bits, as every method's decoding assumes.

Guard: in stage 3 every rank also sends S x_r, a projection of its normalized values onto GUARD_BUCKETS (64) signed
sums (random signs, bit 0 of splitmix64 of a key from the shared seed and the step plus the value's position;
E ||S x||^2 = ||x||^2), with its code (ring: summed in the same allreduce) or its innovation (ps: gathered). Every
rank then knows the exact S of what was to be reconstructed (ring: of the mean; ps: of each rank's values) and
computes the relative error ||S(x - x_hat)|| / ||S x|| of the reconstruction it applied: the same bits on every rank
(they come from the collective's result), without a vote. Where the moving average of these errors (weight 0.25 on
the newest) passes ``max_error``, that tensor goes back to stage 2 for ``train_steps`` steps (the autoencoder trains
on the new gradients), then into stage 3 again. Nothing of a bad step is lost: the residual holds it.

Knobs: ``variant`` (ring | ps), ``ratio`` (k / d, top-k's fraction: 0.01), ``innovation_ratio`` (k' / k, ps: 0.1),
``dense_steps`` and ``train_steps`` (stage lengths; the paper counts epochs, and ``hvdcomp train`` sets both to one
epoch unless given, or takes ``dense_epochs`` and ``train_epochs``), ``channels`` (16), ``code_channels`` (2),
``downsample`` (4 halvings), ``lr`` (Adam, 0.01), ``similarity`` (0.1), ``max_error`` (the guard's bound on the
relative error, 0.9), ``dense_edges`` (true: the model's first and last layers stay dense, as the paper keeps them).
A tensor whose k is under 4 x 2^downsample is kept dense (with a log line), as is a model's first or last layer.

Costs: stage 3 sends per rank, ring, an allreduce of k code_channels / 2^downsample floats plus the leader's
broadcast of k indices (int32; int64 from 2^31 elements); ps, 8 k' bytes of innovation plus the leader's broadcast of
the indices and code; both, the guard's 256 bytes. The guard decides on the host from its two sums (a
:class:`~hvdcomp.requests.Read`): the optimizer copies every tensor's in one transfer a step, once no compressed
collective is left. On CUDA the guard's projection takes one Triton launch and its error two
(:mod:`hvdcomp.kernels.gpu.projection`). The autoencoder's compute runs on the tensor's device.

A state made afresh (an elastic reset, a step skipped for a non-finite gradient) starts from the step counter: after
an elastic reset, whose counters start at 0, that is stage 1 again; where the counter is past stage 2 but the
autoencoder has never trained, the tensor goes through stage 2 first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hvdcomp import check
from hvdcomp.compressor import Compressor, Context, State, derive_seed
from hvdcomp.kernels import is_triton, kernels_for
from hvdcomp.methods.sketch import mix
from hvdcomp.methods.topk import index_dtype, largest
from hvdcomp.reductions import Phase, ReductionMethod
from hvdcomp.requests import Allgather, Allreduce, Broadcast, Read, Reduction, Request, dense_copy
from hvdcomp.wire import Payload

if TYPE_CHECKING:
    from hvdcomp.perfmodel.schema import Encoded

VARIANTS = ("ring", "ps")
#: the guard's projection of the k values (Projection): 64 signed sums, 256 bytes more per rank and step
GUARD_BUCKETS = 64
#: the guard's smoothing: an exponentially weighted moving average of the stage-3 errors, this weight on the newest
GUARD_ALPHA = 0.25
_KERNEL = 4  # stride 2, padding 1: each convolution halves the length, each transposed one doubles it
_SLOPE = 0.2  # LeakyReLU's
_BETAS = (0.9, 0.999)
_EPS = 1e-8

Weights = dict[str, torch.Tensor]


class Projection:
    """The guard's projection S at one step of one tensor: GUARD_BUCKETS sums of consecutive signed values (x padded
    with zeros to a multiple of GUARD_BUCKETS), a linear projection with E ||S x||^2 = ||x||^2, summed over ranks by
    the same collective as the payload. Value i's sign is bit 0 of splitmix64(``key`` + i), ``key`` below 2^62 (so
    that key + i never wraps): on CUDA one Triton launch draws and sums (:mod:`hvdcomp.kernels.gpu.projection`, the
    same signs, its own order of addition); on the PyTorch path the signs are drawn once, for every projection of the
    step."""

    def __init__(self, key: int) -> None:
        self.key = key
        self._signs: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """S x."""
        kernels = kernels_for(x.device)
        if is_triton(kernels):
            return kernels.projection(x.float().contiguous(), self.key, GUARD_BUCKETS)
        length = -(-x.numel() // GUARD_BUCKETS) * GUARD_BUCKETS
        if self._signs is None or self._signs.numel() != length or self._signs.device != x.device:
            self._signs = 1.0 - 2.0 * (mix(torch.arange(length, device=x.device) + self.key) & 1).float()
        return (F.pad(x, (0, length - x.numel())) * self._signs).view(GUARD_BUCKETS, -1).sum(1)

    def error(self, exact: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(||exact - S x||^2, ||exact||^2), float32 [2]: the guard's measure of reconstruction ``x`` against the
        projection ``exact`` of what it reconstructs (two Triton launches on CUDA)."""
        kernels = kernels_for(x.device)
        if is_triton(kernels):
            return kernels.projection_error(exact.float().contiguous(), x.float().contiguous(), self.key)
        return torch.stack([(exact - self(x)).square().sum(), exact.square().sum()])


def _deterministic() -> contextlib.AbstractContextManager[None]:
    """cuDNN's deterministic convolution algorithms, chosen without benchmarking (a no-op on CPU)."""
    return torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False, deterministic=True)


def _layer(weights: Weights, generator: torch.Generator, name: str, shape: tuple[int, int, int], fan_in: int) -> None:
    """PyTorch's default initialization of a convolution (uniform within 1 / sqrt(fan_in)), from ``generator``."""
    bound = 1 / math.sqrt(fan_in)
    weights[f"{name}.weight"] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
    out_channels = shape[1] if name.startswith("decoder") else shape[0]
    weights[f"{name}.bias"] = (torch.rand(out_channels, generator=generator) * 2 - 1) * bound


class LGC(Compressor):
    """LGC's three stages and two variants (see the module docstring for each knob)."""

    name = "lgc"
    unbiased = False
    own_memory = True  # its error feedback spans the stages and holds the autoencoder's error
    reduction = "lgc"
    epoch_options = ("dense_steps", "train_steps")

    def __init__(self, variant: str = "ring", ratio: float = 0.01, innovation_ratio: float = 0.1,
                 dense_steps: int = 100, train_steps: int = 100, channels: int = 16, code_channels: int = 2,
                 downsample: int = 4, lr: float = 1e-2, similarity: float = 0.1, max_error: float = 0.9,
                 dense_edges: bool = True) -> None:
        check.choice(self.name, "variant", variant, VARIANTS)
        for key, value in (("ratio", ratio), ("innovation_ratio", innovation_ratio)):
            check.number(self.name, key, value, gt=0, le=1)
        for key, value, low in (("dense_steps", dense_steps, 0), ("train_steps", train_steps, 1),
                                ("channels", channels, 1), ("code_channels", code_channels, 1),
                                ("downsample", downsample, 1)):
            check.integer(self.name, key, value, ge=low)
        check.number(self.name, "lr", lr, gt=0)
        for key, value in (("similarity", similarity), ("max_error", max_error)):
            check.number(self.name, key, value, ge=0)
        check.boolean(self.name, "dense_edges", dense_edges)
        self.variant = variant
        self.ratio, self.innovation_ratio = float(ratio), float(innovation_ratio)
        self.dense_steps, self.train_steps = dense_steps, train_steps
        self.channels, self.code_channels, self.downsample = channels, code_channels, downsample
        self.lr, self.similarity, self.max_error = float(lr), float(similarity), float(max_error)
        self.dense_edges = dense_edges

    def steady_from(self) -> int:
        return self.dense_steps + self.train_steps

    # ------------------------------------------------------------------------------------------ sizes

    def k(self, numel: int) -> int:
        """Top-k's k for a tensor of ``numel`` entries."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def innovation_k(self, k: int) -> int:
        """k', the values of a ps innovation."""
        return max(1, math.ceil(self.innovation_ratio * k))

    @property
    def min_k(self) -> int:
        """The smallest k the encoder takes: 4 code positions."""
        return 4 << self.downsample

    def compresses(self, shape: torch.Size) -> bool:
        """Tensors whose k reaches :attr:`min_k`; the optimizer logs the others, which stay dense."""
        return self.k(math.prod(shape)) >= self.min_k

    def why_dense(self, shape: torch.Size) -> str:
        k = self.k(math.prod(shape))
        return (f"lgc: a tensor of shape {tuple(shape)} has {k} top-k values (ratio {self.ratio:g}), fewer than the "
                f"encoder's minimum of {self.min_k} (4 x 2^downsample)")

    def length(self, k: int) -> int:
        """The autoencoder's input length: k padded to a multiple of 2^downsample."""
        step = 1 << self.downsample
        return -(-k // step) * step

    def code_numel(self, k: int) -> int:
        """The values in one code of k inputs."""
        return self.code_channels * (self.length(k) >> self.downsample)

    def stage(self, state: State, step: int) -> int:
        """1, 2 or 3 at ``step``, from the stage lengths and the guard's ``retrain_until``."""
        if step < self.dense_steps:
            return 1
        if step < self.dense_steps + self.train_steps or step < state["retrain_until"]:
            return 2
        return 3

    # ---------------------------------------------------------------------------------- autoencoder

    def init_weights(self, ranks: int, seed: int) -> Weights:
        """The autoencoder's weights, drawn on the CPU from ``seed`` (the same on every rank and device)."""
        generator = torch.Generator().manual_seed(seed)
        weights: Weights = {}
        c, q, d = self.channels, self.code_channels, self.downsample
        for i in range(d):
            cin, cout = 1 if i == 0 else c, q if i == d - 1 else c
            _layer(weights, generator, f"encoder.{i}", (cout, cin, _KERNEL), cin * _KERNEL)
        decoders = ["decoder"] if self.variant == "ring" else [f"decoder.{r}" for r in range(ranks)]
        for prefix in decoders:
            for i in range(d):
                cin = q if i == 0 else c
                cout = 1 if self.variant == "ring" and i == d - 1 else c
                _layer(weights, generator, f"{prefix}.{i}", (cin, cout, _KERNEL), cout * _KERNEL)
            if self.variant == "ps":  # features and the rank's innovation, mixed by a 1x1 convolution
                output = prefix.replace("decoder", "output")
                _layer(weights, generator, output, (1, c + 1, 1), c + 1)
        return weights

    def encode(self, weights: Weights, x: torch.Tensor) -> torch.Tensor:
        """Codes (B, code_channels, L / 2^downsample) of inputs x (B, 1, L)."""
        with _deterministic():
            for i in range(self.downsample):
                x = F.conv1d(x, weights[f"encoder.{i}.weight"], weights[f"encoder.{i}.bias"], stride=2, padding=1)
                if i < self.downsample - 1:
                    x = F.leaky_relu(x, _SLOPE)
        return x

    def decode(self, weights: Weights, code: torch.Tensor, rank: int = 0,
               innovation: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 1, L) from codes: the ring decoder, or rank ``rank``'s ps decoder with its innovation (B, 1, L)."""
        prefix = "decoder" if self.variant == "ring" else f"decoder.{rank}"
        x = code
        with _deterministic():
            for i in range(self.downsample):
                x = F.conv_transpose1d(x, weights[f"{prefix}.{i}.weight"], weights[f"{prefix}.{i}.bias"], stride=2,
                                       padding=1)
                if self.variant == "ps" or i < self.downsample - 1:
                    x = F.leaky_relu(x, _SLOPE)
            if self.variant == "ring":
                return x
            output = f"output.{rank}"
            mixed = F.conv1d(torch.cat([x, innovation], dim=1), weights[f"{output}.weight"], weights[f"{output}.bias"])
        return torch.where(innovation != 0, innovation, mixed)  # the rank's own values where it sent them

    def innovation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k' of x (B, k): values and positions (int32)."""
        positions = x.abs().topk(self.innovation_k(x.shape[1]), dim=1, sorted=False).indices
        return x.gather(1, positions), positions.to(torch.int32)

    def scatter(self, values: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Innovations (B, k') placed in zeros (B, 1, length)."""
        out = values.new_zeros(values.shape[0], length)
        return out.scatter_(1, positions.long(), values).unsqueeze(1)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Values (B, k) as the autoencoder's input (B, 1, L), zero-padded."""
        return F.pad(x, (0, self.length(x.shape[1]) - x.shape[1])).unsqueeze(1)

    def train_step(self, state: State, batch: torch.Tensor, leader: int) -> None:
        """One Adam step of the autoencoder on every rank's normalized values ``batch`` (N, k) (module docstring's
        loss); the losses are kept, as tensors, in ``state["last"]``."""
        k = batch.shape[1]
        with torch.enable_grad():
            weights = {key: value.detach().requires_grad_() for key, value in state["ae"].items()}
            x = self.pad(batch)
            codes = self.encode(weights, x)
            mean_code = codes.mean(0, keepdim=True)
            similarity = (codes - mean_code).square().mean()
            if self.variant == "ring":
                reconstruction = F.mse_loss(self.decode(weights, mean_code)[..., :k], x.mean(0, keepdim=True)[..., :k])
            else:
                values, positions = self.innovation(batch)
                innovations = self.scatter(values, positions, x.shape[-1])
                leader_code = codes[leader:leader + 1]
                reconstruction = torch.stack([
                    F.mse_loss(self.decode(weights, leader_code, r, innovations[r:r + 1])[..., :k], x[r:r + 1, :, :k])
                    for r in range(batch.shape[0])]).mean()
            loss = reconstruction + self.similarity * similarity
            grads = torch.autograd.grad(loss, list(weights.values()))
        self._adam(state, grads)
        state["last"]["loss"] = torch.stack([reconstruction.detach(), similarity.detach()])

    def _adam(self, state: State, grads: tuple[torch.Tensor, ...]) -> None:
        adam = state["adam"]
        adam["t"] += 1
        t = adam["t"]
        b1, b2 = _BETAS
        for (key, weight), grad in zip(state["ae"].items(), grads, strict=True):
            m, v = adam["m"][key], adam["v"][key]
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denominator = (v / (1 - b2 ** t)).sqrt_().add_(_EPS)
            weight.addcdiv_(m, denominator, value=-self.lr / (1 - b1 ** t))

    # ---------------------------------------------------------------------------------------- state

    def init_state(self, tensor: torch.Tensor, ctx: Context) -> State:
        weights = {key: value.to(ctx.device) for key, value in self.init_weights(ctx.size, ctx.shared_seed).items()}
        return {"residual": torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device),
                "ae": weights,
                "adam": {"t": 0, "m": {key: torch.zeros_like(w) for key, w in weights.items()},
                         "v": {key: torch.zeros_like(w) for key, w in weights.items()}},
                "retrain_until": 0, "fallbacks": 0, "synced": False, "smoothed_error": None, "last": {}}

    def plan(self, state: State) -> str:
        return f"{self.variant} retrain_until {state['retrain_until']} fallbacks {state['fallbacks']}"

    def decisions(self, state: State) -> list[Any] | None:
        """[stage, the guard's relative reconstruction error (stage 3; else None), fallbacks so far] of the last
        step."""
        if not state["last"]:
            return None
        error = state["last"].get("error")
        return [state["last"]["stage"], None if error is None else round(error, 5), state["fallbacks"]]

    @staticmethod
    def projection(ctx: Context) -> Projection:
        """The guard's projection at ``ctx``'s step, the same on every rank."""
        return Projection(derive_seed(ctx.shared_seed, "guard", ctx.step) >> 1)

    def guard(self, state: State, step: int, error: torch.Tensor) -> None:
        """Stage 3's check, from (||S(exact - reconstructed)||^2, ||S exact||^2) summed over the tensor's values:
        the same bits on every rank (they come from the collective's result), on the host. Where the
        moving average of the relative errors since stage 3 began (GUARD_ALPHA) passes ``max_error``, the next
        ``train_steps`` steps are stage 2 again."""
        squared, norm = error.tolist()
        relative = state["last"]["error"] = math.sqrt(squared / norm) if norm > 0 else 0.0
        smoothed = state["smoothed_error"]
        smoothed = relative if smoothed is None else (1 - GUARD_ALPHA) * smoothed + GUARD_ALPHA * relative
        state["smoothed_error"] = smoothed
        if smoothed > self.max_error:
            state["retrain_until"] = step + 1 + self.train_steps
            state["fallbacks"] += 1
            state["smoothed_error"] = None

    def select(self, p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The leader's part: its top-k indices, sorted (neighbouring parameters side by side in the
        autoencoder's input), and its scale, RMS(p[I]) (1 where that is 0)."""
        indices = largest(p, k).sort().values
        scale = p[indices].square().mean().sqrt().reshape(1)
        return indices.to(index_dtype(p.numel())), torch.where(scale > 0, scale, 1.0)

    # ---------------------------------------------------------------------- one rank (bench, profile)

    def compress(self, tensor: torch.Tensor, state: State, ctx: Context,
                 agreed: torch.Tensor | None = None) -> tuple[Payload, Any]:
        """One rank on its own, as the leader in stage 3 (no collectives: benchmarks and profiles), with what the
        reduction sends: ring, (I, s, code and the guard's S x); ps, (I, s and code, innovation values and S x,
        innovation positions)."""
        p = state["residual"].add_(tensor.detach().reshape(-1))
        k = self.k(p.numel())
        indices, scale = self.select(p, k)
        index = indices.long()
        selected = p[index]  # (p is not written before the residual's update below)
        x = selected / scale
        with torch.no_grad():
            code = self.encode(state["ae"], self.pad(x.unsqueeze(0))).reshape(-1)
        check = self.projection(ctx)(x)
        meta = (tensor.shape, k, state["ae"])
        if self.variant == "ring":
            payload = [indices, scale, torch.cat([code, check])]
        else:
            values, positions = self.innovation(x.unsqueeze(0))
            payload = [indices, torch.cat([scale, code]), torch.cat([values.reshape(-1), check]), positions.reshape(-1)]
        state["residual"].index_copy_(0, index, selected - self.decoded_values(payload, k, state["ae"]))
        return payload, meta

    def decoded_values(self, payload: Payload, k: int, weights: Weights) -> torch.Tensor:
        """The k values a one-rank payload (:meth:`compress`) decodes to, at its indices."""
        with torch.no_grad():
            if self.variant == "ring":
                scale, code = payload[1], payload[2][:self.code_numel(k)]
                return self.decode(weights, code.view(1, self.code_channels, -1))[0, 0, :k] * scale
            scale, code = payload[1][:1], payload[1][1:]
            kept = payload[3].numel()
            innovation = self.scatter(payload[2][:kept].view(1, -1), payload[3].view(1, -1), self.length(k))
            return self.decode(weights, code.view(1, self.code_channels, -1), 0, innovation)[0, 0, :k] * scale

    def decompress(self, payload: Payload, meta: Any) -> torch.Tensor:
        shape, k, weights = meta
        out = torch.zeros(math.prod(shape), dtype=torch.float32, device=payload[0].device)
        return out.index_copy_(0, payload[0].long(), self.decoded_values(payload, k, weights)).view(shape)


class LGCReduction(ReductionMethod):
    """LGC's step in its stage: dense allreduce; the leader's indices, every rank's values gathered and the
    autoencoder trained; or the ring's summed codes, or the ps leader's code and every rank's innovation.
    Returns the sum over ranks (the optimizer averages)."""

    name = "lgc"

    @classmethod
    def rejects(cls, traits: Any) -> str | None:
        return None if traits.reduction == cls.name else f"{traits!r} is not LGC"

    # Costs for the performance model, in stage 3 (the steady state), from the leader's profiled payload: the
    # broadcast is priced as the allgather of an N-th of it per rank (the same ring volume), then the ring's codes
    # (allreduce) or the ps innovations (allgather); the guard's S x travels with them.

    @classmethod
    def phases(cls, e: Encoded, workers: int) -> list[Phase]:
        parts = e.part_bytes  # LGC.compress's payload: ring (I, s, code), ps (I, s and code, innovation, positions)
        broadcast = Phase("allgather", (parts[0] + parts[1]) / workers)
        if len(parts) == 3:  # ring: the code and the guard's sums allreduced
            return [broadcast, Phase("allreduce", parts[2])]
        return [broadcast, Phase("allgather", parts[2] + parts[3])]  # ps: the innovation and the sums gathered

    def reduce(self, tensor: torch.Tensor, state: State, ctx: Context) -> Reduction:
        method: LGC = self.compressor  # type: ignore[assignment]  # own_memory: never wrapped
        stage = method.stage(state, ctx.step)
        if stage == 3 and state["adam"]["t"] == 0:  # a state made afresh past stage 2: train the autoencoder first
            state["retrain_until"] = ctx.step + method.train_steps
            stage = 2
        state["last"] = {"stage": stage}
        if stage == 1:
            (summed,) = yield Allreduce([dense_copy(tensor)])
            return summed
        p = state["residual"].add_(tensor.detach().reshape(-1))
        k, leader = method.k(p.numel()), ctx.step % ctx.size
        if stage == 2:
            state["synced"] = False
            indices, scale = yield from self._leader(method, p, k, leader, ctx)
            index = indices.long()
            values = p[index]
            gathered = yield Allgather([values], fixed_size=True)
            total = gathered[0][0].clone()
            for (other,) in gathered[1:]:  # rank order: the same bits on every rank
                total += other
            p.index_fill_(0, index, 0)
            method.train_step(state, torch.stack([v for (v,) in gathered]) / scale, leader)
            return self._placed(total, index, p, tensor.shape)
        if not state["synced"]:  # entering stage 3: every rank decodes with rank 0's weights
            names = list(state["ae"])
            flat = torch.cat([state["ae"][name].reshape(-1) for name in names])
            (flat,) = yield Broadcast([flat], root=0)
            for name, part in zip(names, flat.split([state["ae"][n].numel() for n in names]), strict=True):
                state["ae"][name].copy_(part.view_as(state["ae"][name]))
            state["synced"] = True
        weights = state["ae"]
        projection = method.projection(ctx)
        if method.variant == "ring":
            indices, scale = yield from self._leader(method, p, k, leader, ctx)
            index = indices.long()
            selected = p[index]  # (p is not written before the residual's update below)
            x = selected / scale
            code = method.encode(weights, method.pad(x.unsqueeze(0)))
            (summed,) = yield Allreduce([torch.cat([code.reshape(-1), projection(x)])])
            mean = method.decode(weights, summed[:code.numel()].view_as(code) / ctx.size)[0, 0, :k]
            reconstruction = mean * scale  # the estimate of the mean of the ranks' values, this rank's share
            total = reconstruction * ctx.size
            exact = summed[code.numel():] / ctx.size  # S of the exact mean: the guard's reference
            error = projection.error(exact, mean)
        else:
            indices, scale, code = yield from self._leader(method, p, k, leader, ctx, weights)
            index = indices.long()
            selected = p[index]
            x = selected / scale
            values, positions = method.innovation(x.unsqueeze(0))
            gathered = yield Allgather([torch.cat([values.reshape(-1), projection(x)]),
                                        positions.reshape(-1)], fixed_size=True)
            kept = values.numel()
            length = method.length(k)
            total = torch.zeros(k, dtype=torch.float32, device=p.device)
            error = torch.zeros(2, dtype=torch.float32, device=p.device)
            decoded = []
            for r, (head, inno_positions) in enumerate(gathered):  # rank order: the same bits everywhere
                innovation = method.scatter(head[:kept].view(1, -1), inno_positions.view(1, -1), length)
                decoded.append(method.decode(weights, code, r, innovation)[0, 0, :k])
                total += decoded[r] * scale
                error += projection.error(head[kept:], decoded[r])
            reconstruction = decoded[ctx.rank] * scale
        p.index_copy_(0, index, selected - reconstruction)
        method.guard(state, ctx.step, (yield Read(error)))
        return self._placed(total, index, p, tensor.shape)

    def _leader(self, method: LGC, p: torch.Tensor, k: int, leader: int, ctx: Context,
                weights: Weights | None = None) -> Generator[Request, Any, tuple[torch.Tensor, ...]]:
        """Generator: the leader's indices and scale on every rank, by one broadcast; given the autoencoder's
        ``weights`` (ps), the leader's code too."""
        code_numel = 0 if weights is None else method.code_numel(k)
        if ctx.rank == leader:
            indices, head = method.select(p, k)
            if weights is not None:
                code = method.encode(weights, method.pad((p[indices.long()] / head).unsqueeze(0)))
                head = torch.cat([head, code.reshape(-1)])
        else:
            indices = torch.zeros(k, dtype=index_dtype(p.numel()), device=p.device)
            head = torch.zeros(1 + code_numel, dtype=torch.float32, device=p.device)
        indices, head = yield Broadcast([indices, head], root=leader)
        if weights is None:
            return indices, head
        return indices, head[:1], head[1:].view(1, method.code_channels, -1)

    @staticmethod
    def _placed(values: torch.Tensor, index: torch.Tensor, like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``values`` at ``index`` (int64) in zeros like ``like``, shaped ``shape``."""
        out = torch.zeros_like(like)
        return out.index_copy_(0, index, values).view(shape)
