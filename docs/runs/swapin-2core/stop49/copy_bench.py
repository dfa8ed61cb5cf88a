"""The CPU swap-in's layer copy alone, on warm memory: numpy's strided copy (what
engine_adapter/paged_kv._copy does) against a ctypes.memmove per run and a plain copy of the
same bytes. SmolLM2-135M's layout, 64 blocks of 64 tokens, fp32. CPU-s per GB, best of 5."""

import ctypes
import time

import numpy as np
import torch

LAYERS, PARTS, HEADS, TOKENS, DIM, BLOCKS = 30, 2, 3, 64, 64, 64
blocks = torch.randn(BLOCKS, LAYERS, PARTS, HEADS, TOKENS, DIM)  # landing slots
kv = torch.empty(LAYERS, PARTS, HEADS, BLOCKS * TOKENS, DIM)  # the cache's pool


def numpy_copy() -> None:
    for layer in range(LAYERS):
        dest = kv[layer].view(PARTS, HEADS, BLOCKS, TOKENS, DIM)
        source = blocks[:, layer].permute(1, 2, 0, 3, 4)
        np.copyto(dest.view(torch.uint8).numpy(), source.view(torch.uint8).numpy())


def memmove_copy() -> None:
    bs, ks, size = blocks.stride(), kv.stride(), 4
    run = TOKENS * DIM * size
    for layer in range(LAYERS):
        for part in range(PARTS):
            for head in range(HEADS):
                for i in range(BLOCKS):
                    to = (layer * ks[0] + part * ks[1] + head * ks[2] + i * TOKENS * ks[3]) * size
                    at = (i * bs[0] + layer * bs[1] + part * bs[2] + head * bs[3]) * size
                    ctypes.memmove(kv.data_ptr() + to, blocks.data_ptr() + at, run)


flat_source = blocks.view(-1).numpy()
flat_dest = np.empty_like(flat_source)


def plain() -> None:
    np.copyto(flat_dest, flat_source)


for step in (numpy_copy, memmove_copy, plain, numpy_copy, memmove_copy, plain):
    best = 1e9
    for _ in range(5):
        started = time.process_time()
        step()
        best = min(best, time.process_time() - started)
    gb = blocks.numel() * 4 / 1e9
    print(f"{step.__name__:14s} {gb / best:6.2f} GB/s  {best / gb:.3f} CPU-s/GB")
