"""``kvstore bench accuracy``: what a stored KV format costs the model's answers, measured on
the bundled real model with its prefix KV coming back from the store.

::

    kvstore bench accuracy --kv-format e4m3x16 --json PATH [--model default]
        [--num-windows 32] [--block-tokens 64] [--num-prompts 20] [--max-new-tokens 16]
        [--cluster DIR/cluster.toml] [--nodes 12]

One engine (the model in fp32 on CPU, storing ``--kv-format`` blocks). The reference: one
forward over the fixed text (Python's own documentation, ``pydoc_data.topics``: fixed for a
Python version, no download), keeping the logits of every evaluated position; its KV is then
written to the store in ``--kv-format``. Then, per window ``k`` of ``--num-windows``, the
engine prefills the text's first ``k * block_tokens + 1`` tokens, which swaps in blocks
``0 .. k-1`` from the store and computes one token, and teacher-forces the block's other
``block_tokens - 1`` tokens: every one of the ``num_windows * block_tokens`` evaluated
positions predicts its next token mostly from stored KV (at least ``k / (k + 1)`` of it).
The greedy references are computed without the store.

- ``num_positions``: positions compared; ``top1_agreement``: share whose argmax equals the
  reference's; ``perplexity_ratio``: the text's perplexity over those positions, this format
  over the reference; ``max_logit_diff``: the largest |logit difference| anywhere.
- ``identical_greedy`` of ``num_prompts``: greedy continuations (``--max-new-tokens``) of
  prefixes of the same text (whole stored blocks and 7 tokens; the blocks come back from the
  store) that are token for token the reference's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine_adapter.config import add_kv_format_argument


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore bench accuracy``."""
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M) or a dir")
    add_kv_format_argument(parser)
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per KV block")
    parser.add_argument(
        "--num-windows", type=int, default=32, help="evaluated blocks (positions: x block)"
    )
    parser.add_argument("--num-prompts", type=int, default=20, help="greedy continuations")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="per continuation")
    parser.add_argument("--cluster", type=Path, default=None, help="DIR/cluster.toml")
    parser.add_argument("--nodes", type=int, default=12, help="nodes of the local cluster")
    parser.add_argument(
        "--backend", choices=["isal", "zfec"], default="isal", help="erasure code backend"
    )
    parser.add_argument("--no-fsync", action="store_true", help="local cluster without fsync")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="fetch deadline")


def run(args: argparse.Namespace) -> int:
    """Run, print the table, write JSON; 1 if the store was never used."""
    from bench import accuracy_eval  # torch and the engine: not for --help

    return accuracy_eval.run(args)
