"""A small UNet: a stem, encoder stages that halve the resolution, a middle, decoder stages
that double it and concatenate the encoder's output at the same resolution (long skip
connections: the layer graph is a DAG, not a chain), and a 1x1 head; per-pixel regression.

GroupNorm, not BatchNorm: batch statistics would make a microbatched pipeline compute something
different from one device. Sizes from the environment: PIPEPLAN_UNET_DEPTH (3 encoder and 3
decoder stages), PIPEPLAN_UNET_CH (16 base channels, doubled per level), PIPEPLAN_UNET_SIZE
(32: images SIZE x SIZE; a multiple of 2**DEPTH), PIPEPLAN_UNET_IN (3), PIPEPLAN_UNET_OUT (1).
"""

import os

import torch
from torch import nn
from torch.nn import functional as F

DEPTH = int(os.environ.get("PIPEPLAN_UNET_DEPTH", "3"))
CH = int(os.environ.get("PIPEPLAN_UNET_CH", "16"))
SIZE = int(os.environ.get("PIPEPLAN_UNET_SIZE", "32"))
IN = int(os.environ.get("PIPEPLAN_UNET_IN", "3"))
OUT = int(os.environ.get("PIPEPLAN_UNET_OUT", "1"))


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(min(8, cout), cout), nn.SiLU(),
        nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(min(8, cout), cout), nn.SiLU(),
    )


class Down(nn.Module):
    """Encoder stage: conv block at this resolution; returns the features (kept for the skip)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = conv_block(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, cin, H, W) -> (B, cout, H/2, W/2)
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    """Decoder stage: upsample, concatenate the skip, conv block."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = conv_block(cin // 2 + cskip, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:  # -> (B, cout, 2H, 2W)
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        chans = [CH * 2**i for i in range(DEPTH + 1)]  # per level: CH, 2CH, 4CH, ...
        self.stem = conv_block(IN, chans[0])
        self.down = nn.ModuleList([Down(chans[i], chans[i + 1]) for i in range(DEPTH)])
        self.mid = conv_block(chans[-1], chans[-1])
        self.up = nn.ModuleList(
            [Up(chans[i + 1], chans[i], chans[i]) for i in reversed(range(DEPTH))]
        )
        self.head = nn.Conv2d(chans[0], OUT, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, IN, S, S) -> (B, OUT, S, S)
        x = self.stem(x)
        skips = [x]
        for down in self.down:
            x = down(x)
            skips.append(x)
        x = self.mid(skips.pop())
        for up in self.up:
            x = up(x, skips.pop())
        return self.head(x)


def build_model() -> nn.Module:
    return UNet()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x = torch.randn(batch_size, IN, SIZE, SIZE)
    return (x,), torch.randn(batch_size, OUT, SIZE, SIZE)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
