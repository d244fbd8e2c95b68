"""The training workloads that ship with hvdcomp: a real classifier and a communication-heavy model.

* ``digits``: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; the data ships inside the
  scikit-learn package, no download), a 3-layer MLP of 83 k parameters. Small and compute-light: it shows
  accuracy, not speed.
* ``synthetic``: Gaussian inputs labelled by a fixed random teacher network, learned by an MLP with large
  fully-connected layers (1024-4096-4096-1024-10, 25.2 M parameters, 101 MB of float32 gradient per step):
  the regime (AlexNet's and VGG's fully-connected layers) where the TernGrad paper found compression pays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


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


WORKLOADS = {"digits": digits, "synthetic": synthetic}
