"""Byte-level corpus and a deterministic, seeded batch sampler for the benchmarks.

The default corpus is the set of ``*.txt`` files in ``benchmarks/data/`` (see its README.md).
Tokens are raw bytes, so the vocabulary is 256 and a uniform model has loss ln(256) ~ 5.55.
"""
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
VOCAB_SIZE = 256


def load_corpus(path=None):
    """Return the corpus as a 1-D uint8 tensor; ``path`` is a file or a folder of ``*.txt``."""
    path = Path(path) if path else DATA_DIR
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files under {path}")
    raw = b"\n".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def split_corpus(tokens, val_fraction=0.1):
    """Split into (train, val) along the byte stream: the tail is held out."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


class BatchSampler:
    """Random contiguous windows of ``seq_len + 1`` bytes, reproducible from ``seed``.

    Each call to :meth:`next` returns ``(x, y)`` int64 tensors of shape ``(batch, seq_len)``
    where ``y`` is ``x`` shifted left by one token. ``rank`` offsets the seed so that data
    parallel ranks draw different windows while the run stays deterministic.
    """

    def __init__(self, tokens, batch_size, seq_len, seed=0, rank=0):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
        self.tokens = tokens.to(torch.int64)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed * 1000003 + rank)

    def next(self, device="cpu"):
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]
        x, y = windows[:, :-1], windows[:, 1:]
        return x.to(device).contiguous(), y.to(device).contiguous()

    def __iter__(self):
        while True:
            yield self.next()
