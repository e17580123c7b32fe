"""The 161 parameter shapes of ResNet-50 (25.56M float32 elements), in registration order."""

from __future__ import annotations


def resnet50_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out_channels = 4 * width
            shapes += [(width, in_channels, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out_channels, width, 1, 1), (out_channels,), (out_channels,)]
            if block == 0:
                shapes += [(out_channels, in_channels, 1, 1), (out_channels,), (out_channels,)]
            in_channels = out_channels
    shapes += [(1000, 2048), (1000,)]
    return shapes
