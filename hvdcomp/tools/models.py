"""Two standard models, for profiling (``hvdcomp profile --model hvdcomp.tools.models:resnet18 --batch
hvdcomp.tools.models:resnet18_batch``) where torchvision is not installed: the shapes of the models the
gradient-compression papers measure, defined here in plain PyTorch.

* :func:`resnet18`: ResNet-18 (He et al., CVPR 2016) as it is trained on CIFAR-10 (a 3x3 stem, no max-pool): four
  stages of two basic blocks, 64 to 512 channels, 11.2 M parameters; input 3 x 32 x 32, 10 classes.
* :func:`transformer`: a Transformer encoder classifier (Vaswani et al., NeurIPS 2017; pre-norm, ReLU): a
  30,000-token embedding of width 512, 6 layers of 8 heads and a 2,048-wide feed-forward, mean-pooled into 2
  classes, 34.3 M parameters; input 128 token ids.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 for 32 x 32 images."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    channels = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def resnet18_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random CIFAR-shaped images and labels."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch_size,),
                                                                                  generator=generator)


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a pre-norm Transformer encoder, mean pooling, a linear classifier."""

    def __init__(self, vocab: int = 30_000, width: int = 512, layers: int = 6, heads: int = 8, feedforward: int = 2048,
                 length: int = 128, classes: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, feedforward, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.tokens(ids) + self.positions[:ids.shape[1]])
        return self.head(self.norm(x).mean(dim=1))


def transformer() -> nn.Module:
    """The Transformer encoder classifier of the module docstring."""
    return TransformerClassifier()


def transformer_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (128 per sample) and labels."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 30_000, (batch_size, 128), generator=generator), torch.randint(0, 2, (batch_size,),
                                                                                         generator=generator)
