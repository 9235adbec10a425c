"""Small models several test files share; every test compares them with eager."""
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.GELU(), nn.Linear(2 * d, d),
                                    nn.Tanh(), nn.Linear(d, 4))

    def forward(self, x):
        return self.layers(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


class Block(nn.Module):
    """A pre-norm transformer block: attention with softmax, then an MLP; with `causal`, a causal
    mask made at each call for its length (dynamic shapes: a tensor sized by the input)."""

    def __init__(self, d=32, heads=4, causal=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        h = self.heads
        q = q.reshape(b, s, h, d // h).transpose(1, 2)
        k = k.reshape(b, s, h, d // h).transpose(1, 2)
        v = v.reshape(b, s, h, d // h).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / (d // h) ** 0.5
        if self.causal:
            scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class DenseLayer(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv(torch.relu(self.bn(x)))


class DenseBlock(nn.Module):
    """DenseNet-style: every layer reads the concatenation of all earlier outputs."""

    def __init__(self, cin=4, growth=4, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(layers))
        self.head = nn.Linear(cin + layers * growth, 3)

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return self.head(torch.cat(features, 1).mean((2, 3)))
