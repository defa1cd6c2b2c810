"""Small models that are not a stack of identical blocks, built from code with seeded random weights.

Each factory returns (module, example_inputs) and is what `nesa-node run --graph-model
nesa_node.graph.models:<factory>` loads: a ResNet-style CNN, a ViT-style classifier with two heads, and a U-Net-style
denoiser whose skip connections cross pipeline stages. The modules are in eval mode and avoid shape-dependent
Python (no `x.shape` reads), so `torch.fx` traces them into graphs of tensors only. Weights come from a private
generator state (`torch.random.fork_rng`), so building a model leaves the global RNG as it was.
"""

from __future__ import annotations

import torch
from torch import nn

EXAMPLE_BATCH = 2  # rows of the example inputs


class _ResidualBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels_out)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and channels_in == channels_out
            else nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )
        )

    def forward(self, x):  # (batch, channels_in, height, width)
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))  # (batch, channels_out, height / stride, width / stride)


class ResNetTiny(nn.Module):
    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(
            _ResidualBlock(width, width, 1),
            _ResidualBlock(width, 2 * width, 2),
            _ResidualBlock(2 * width, 2 * width, 1),
            _ResidualBlock(2 * width, 4 * width, 2),
            _ResidualBlock(4 * width, 4 * width, 1),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, image):  # (batch, 3, 32, 32)
        features = self.blocks(self.stem(image))  # (batch, 4 * width, 8, 8)
        return self.head(features.mean(dim=(2, 3)))  # (batch, classes)


class _EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (width // heads) ** -0.5
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.project = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):  # (batch, tokens, width)
        h = self.norm1(x)
        q = self.query(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)  # (batch, heads, tokens, head_dim)
        k = self.key(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        v = self.value(h).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        attention = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)  # (batch, heads, tokens, tokens)
        x = x + self.project((attention @ v).transpose(1, 2).flatten(2))  # (batch, tokens, width)
        return x + self.mlp(self.norm2(x))


class VitTiny(nn.Module):
    """Patch embedding, encoder blocks, and two heads on the pooled tokens: classes and a 4-value box."""

    def __init__(self, classes: int = 10, width: int = 64, depth: int = 4, heads: int = 4, patch: int = 4):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.position = nn.Parameter(torch.randn(1, (32 // patch) ** 2, width) * 0.02)
        self.blocks = nn.Sequential(*(_EncoderBlock(width, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.class_head = nn.Linear(width, classes)
        self.box_head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4))

    def forward(self, image):  # (batch, 3, 32, 32)
        tokens = self.embed(image).flatten(2).transpose(1, 2) + self.position  # (batch, 64, width)
        pooled = self.norm(self.blocks(tokens)).mean(dim=1)  # (batch, width)
        return self.class_head(pooled), self.box_head(pooled)  # (batch, classes), (batch, 4)


class _ConvBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, embedding: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, channels_out)
        self.time = nn.Linear(embedding, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels_out)

    def forward(self, x, embedding):  # (batch, channels_in, h, w), (batch, embedding)
        y = nn.functional.silu(self.norm1(self.conv1(x)))
        y = y + self.time(embedding)[:, :, None, None]  # noise level, broadcast over pixels
        return nn.functional.silu(self.norm2(self.conv2(y)))  # (batch, channels_out, h, w)


class UNetTiny(nn.Module):
    """Three resolutions down and up, with the encoder features concatenated into the decoder (skips)."""

    def __init__(self, width: int = 16, embedding: int = 32):
        super().__init__()
        self.embed_noise = nn.Sequential(nn.Linear(1, embedding), nn.SiLU(), nn.Linear(embedding, embedding))
        self.down1 = _ConvBlock(3, width, embedding)
        self.down2 = _ConvBlock(width, 2 * width, embedding)
        self.middle = _ConvBlock(2 * width, 4 * width, embedding)
        self.up2 = _ConvBlock(4 * width + 2 * width, 2 * width, embedding)
        self.up1 = _ConvBlock(2 * width + width, width, embedding)
        self.pool = nn.AvgPool2d(2)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, noisy, noise_level):  # (batch, 3, 32, 32), (batch, 1)
        embedding = self.embed_noise(noise_level)  # (batch, embedding)
        skip1 = self.down1(noisy, embedding)  # (batch, width, 32, 32)
        skip2 = self.down2(self.pool(skip1), embedding)  # (batch, 2 width, 16, 16)
        middle = self.middle(self.pool(skip2), embedding)  # (batch, 4 width, 8, 8)
        up2 = self.up2(torch.cat([self.upsample(middle), skip2], dim=1), embedding)  # (batch, 2 width, 16, 16)
        up1 = self.up1(torch.cat([self.upsample(up2), skip1], dim=1), embedding)  # (batch, width, 32, 32)
        return noisy - self.out(up1)  # predicted clean image, (batch, 3, 32, 32)


def _build(factory, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory().eval()
        return module, torch.randn(EXAMPLE_BATCH, 3, 32, 32)


def resnet_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    module, image = _build(ResNetTiny, seed=11)
    return module, (image,)


def vit_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    module, image = _build(VitTiny, seed=12)
    return module, (image,)


def unet_tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    module, image = _build(UNetTiny, seed=13)
    return module, (image, torch.linspace(0.1, 0.9, EXAMPLE_BATCH).unsqueeze(1))


FACTORIES = {"resnet_tiny": resnet_tiny, "vit_tiny": vit_tiny, "unet_tiny": unet_tiny}
