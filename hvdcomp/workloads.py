"""The training workloads that ship with hvdcomp: a real classifier and a communication-heavy model.

* ``digits``: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; the data ships inside the
  scikit-learn package, no download), a 3-layer MLP of 83 k parameters. Small and compute-light: it shows
  accuracy, not speed.
* ``synthetic``: Gaussian inputs labelled by a fixed random teacher network, learned by an MLP with large
  fully-connected layers (1024-4096-4096-1024-10, 25.2 M parameters, 101 MB of float32 gradient per step):
  the regime (AlexNet's and VGG's fully-connected layers) where the TernGrad paper found compression pays.
* ``bow``: a bag-of-words topic classifier dominated by an embedding table with sparse gradients
  (``nn.EmbeddingBag(100000, 32, sparse=True)``: all but 264 of its 3.2 M parameters), on synthetic documents: 32 words
  each, drawn from a Zipf law (exponent 1.05) over the vocabulary, half of them from the vocabulary of the
  document's topic (8 topics). A step of 64 documents touches about 1,100 of the 100,000 rows, the popular ones on
  every rank: the regime (NCF's and language models' embeddings) where the homomorphic sketch was measured.
* ``glyphs``: an accuracy workload harder than digits, of MNIST's shape (generated: no download): 30,000
  training and 5,000 test images of 28 x 28, 10 classes, learned by an MLP 784-512-256-10 (536 k parameters).
  Each class has 4 glyphs, smooth random strokes (a 7 x 7 Gaussian field upsampled and squashed), and an image
  is one of its class's glyphs shifted by up to 3 pixels each way, at a random intensity, under Gaussian pixel
  noise (sigma 0.7). Dense SGD with momentum 0.9 trains best at lr 0.1, to about 97.5% in 3 epochs of 234 steps on
  2 ranks (perf/accuracy/README.md): enough steps, and enough left to learn, for compression's errors to show where
  digits hides them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from hvdcomp import extras


@dataclass(frozen=True)
class Dataset:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def to(self, device: torch.device) -> Dataset:
        return Dataset(self.train_x.to(device), self.train_y.to(device), self.test_x.to(device),
                       self.test_y.to(device))


@dataclass(frozen=True)
class Workload:
    name: str
    model: nn.Module
    data: Dataset
    #: defaults of the training loop for this workload
    epochs: int
    batch_size: int
    lr: float


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def digits(seed: int) -> Workload:
    with extras.required("digits", "the digits workload"):
        from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # a fixed split
    test, train = order[:360], order[360:]
    torch.manual_seed(seed)
    return Workload("digits", _mlp(64, 512, 96, 10), Dataset(x[train], y[train], x[test], y[test]),
                    epochs=20, batch_size=32, lr=0.05)


def synthetic(seed: int, train_samples: int = 2048, test_samples: int = 512) -> Workload:
    generator = torch.Generator().manual_seed(4321)  # the task is fixed; `seed` only initializes the model
    teacher = [torch.randn(1024, 64, generator=generator) / 32, torch.randn(64, 10, generator=generator) / 8]

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 1024, generator=generator)
        return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)

    train_x, train_y = sample(train_samples)
    test_x, test_y = sample(test_samples)
    torch.manual_seed(seed)
    return Workload("synthetic", _mlp(1024, 4096, 4096, 1024, 10), Dataset(train_x, train_y, test_x, test_y),
                    epochs=2, batch_size=64, lr=0.01)


def bow(seed: int, vocabulary: int = 100_000, dim: int = 32, topics: int = 8, length: int = 32,
        train_samples: int = 8192, test_samples: int = 2048) -> Workload:
    generator = torch.Generator().manual_seed(5678)  # the task is fixed; `seed` only initializes the model
    zipf = torch.arange(1, vocabulary + 1, dtype=torch.float64) ** -1.05
    words_of_topic = torch.argsort(torch.randperm(vocabulary, generator=generator) % topics, stable=True)
    words_of_topic = words_of_topic[:vocabulary // topics * topics].view(topics, -1)
    within = zipf[:words_of_topic.shape[1]]

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, topics, (n,), generator=generator)
        background = torch.multinomial(zipf, n * length, replacement=True, generator=generator).view(n, length)
        ranks = torch.multinomial(within, n * length, replacement=True, generator=generator).view(n, length)
        topical = words_of_topic[labels.unsqueeze(1).expand(n, length), ranks]
        own = torch.rand(n, length, generator=generator) < 0.5
        return torch.where(own, topical, background), labels

    train_x, train_y = sample(train_samples)
    test_x, test_y = sample(test_samples)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.EmbeddingBag(vocabulary, dim, mode="mean", sparse=True), nn.Linear(dim, topics))
    return Workload("bow", model, Dataset(train_x, train_y, test_x, test_y), epochs=5, batch_size=64, lr=0.5)


def glyphs(seed: int, train_samples: int = 30_000, test_samples: int = 5_000, classes: int = 10,
           per_class: int = 4, shift: int = 3, noise: float = 0.7) -> Workload:
    generator = torch.Generator().manual_seed(8765)  # the task is fixed; `seed` only initializes the model
    fields = torch.randn(classes * per_class, 1, 7, 7, generator=generator)
    strokes = torch.sigmoid(4 * nn.functional.interpolate(fields, size=(28, 28), mode="bicubic", align_corners=False))
    padded = nn.functional.pad(strokes.view(classes, per_class, 28, 28), (shift,) * 4)
    grid = torch.arange(28)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, classes, (n,), generator=generator)
        glyph = torch.randint(0, per_class, (n,), generator=generator)
        dy, dx = torch.randint(0, 2 * shift + 1, (2, n, 1, 1), generator=generator)
        images = padded[labels.view(n, 1, 1), glyph.view(n, 1, 1), dy + grid.view(1, 28, 1), dx + grid.view(1, 1, 28)]
        intensity = 0.6 + 0.8 * torch.rand(n, 1, 1, generator=generator)
        images = images * intensity + noise * torch.randn(n, 28, 28, generator=generator)
        return images.reshape(n, 28 * 28), labels

    train_x, train_y = sample(train_samples)
    test_x, test_y = sample(test_samples)
    torch.manual_seed(seed)
    return Workload("glyphs", _mlp(784, 512, 256, 10), Dataset(train_x, train_y, test_x, test_y),
                    epochs=3, batch_size=64, lr=0.1)


WORKLOADS = {"digits": digits, "synthetic": synthetic, "bow": bow, "glyphs": glyphs}
