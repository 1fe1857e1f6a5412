"""ResNet-18 written out by hand (torchvision's layout: conv-bn stem, 4 stages of 2 BasicBlocks,
average pool, linear head), with BatchNorm in training mode. Small by default so tests are fast:
PIPEPLAN_RESNET_WIDTH (8; torchvision's is 64) channels in the first stage, 16x16 images,
PIPEPLAN_RESNET_CLASSES (10) classes."""

import os

import torch
from torch import nn

WIDTH = int(os.environ.get("PIPEPLAN_RESNET_WIDTH", "8"))
CLASSES = int(os.environ.get("PIPEPLAN_RESNET_CLASSES", "10"))
SIZE = int(os.environ.get("PIPEPLAN_RESNET_SIZE", "16"))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, width: int = WIDTH, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)  # (small images: 3x3 stem, no pool)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        chans = [width, 2 * width, 4 * width, 8 * width]
        cin = width
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c, 1)))
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model() -> nn.Module:
    return ResNet18()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 3, SIZE, SIZE),), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)
