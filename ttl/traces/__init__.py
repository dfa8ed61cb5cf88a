"""Request traces: Mooncake, Qwen-Bailian and session files, loaded into one columnar ``Trace``.

Formats (one record per request):

* ``mooncake`` (JSONL): ``timestamp`` (milliseconds), ``input_length``, ``output_length``
  (optional, 0), ``hash_ids`` (prefix-chained block ids: an id names its block together with
  everything before it) and an optional ``class``; records without one get ``--class``. The
  block size comes from ``--block-tokens`` (512 for Mooncake's published traces).
* ``bailian`` (JSONL, Alibaba Qwen-Bailian): ``chat_id``, ``parent_chat_id``, ``timestamp``
  (seconds), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids`` of 16-token
  blocks hashed per block, not chained. ``type`` maps to a class by ``--type-class TYPE=CLASS``;
  unmapped types get ``--class``.
* ``sessions`` (one JSON document per conversation; a file or a folder of ``*.json`` files)::

      {"block_size": 16, "t": 0, "class": "agent",        # t (s) and class are optional
       "requests": [
         {"t": 0.0, "in": 5012, "out": 230, "hash_ids": [0, 1, 2]},
         {"t": 41.5, "requests": [                          # a sub-agent: its own start t,
           {"t": 0.0, "in": 800, "out": 90, "hash_ids": [0, 7]}]}]}  # inner t from that start

  ``t`` counts from the start of the enclosing list; a ``class`` applies to everything under
  it. Ids are local to the file.

Block identity. The store's keys are chained (a block's key covers every token before it), so
every block gets a dense id (``0 .. num_blocks-1``) naming the block *with its prefix*. Mooncake
ids are already chained and are only renumbered. Bailian and session ids are per block, so the
loader chains them: the same id after a different prefix is a different block, and a request's
prefix hit stops at its first missing block exactly as in the store.

Partial blocks. A request of ``L`` input tokens has ``L // B`` full blocks; its hash ids may
also name the trailing partial block (Mooncake's do). ``PARTIAL_DROP`` (the default) keeps
full blocks only, which is what the store and the engine cache (``block_keys`` covers full
blocks; the tail is recomputed); ``PARTIAL_COUNT`` keeps the partial block as a cacheable
block of ``L - i*B`` tokens, the way published trace figures count. Either way the token hit
ratio's denominator (``Trace.hashed_tokens``) covers every token the hash ids name.

Files larger than memory are read in chunks of whole lines and parsed by pyarrow; only dense
integer arrays are kept. Requests are put in time order (stable for equal timestamps). A
malformed line raises ``TraceFormatError`` naming the file and line; with ``skip_bad`` it is
skipped, counted in ``Trace.num_skipped`` and logged. Nothing is dropped silently.
"""

from ttl.traces.ids import chain_identities, cut_partial_blocks, dense_ids, mix64, reorder_segments
from ttl.traces.load import load_trace, parse_type_map, parse_unit, trace_from_records, trace_units
from ttl.traces.model import (
    BAILIAN,
    DEFAULT_BLOCK_TOKENS,
    FORMATS,
    MOONCAKE,
    PARTIAL_BLOCKS,
    PARTIAL_COUNT,
    PARTIAL_DROP,
    SESSIONS,
    BytesProgress,
    LoadOptions,
    MiB,
    RawRequests,
    Trace,
    TraceUnit,
)

__all__ = [
    "BAILIAN",
    "DEFAULT_BLOCK_TOKENS",
    "FORMATS",
    "MOONCAKE",
    "PARTIAL_BLOCKS",
    "PARTIAL_COUNT",
    "PARTIAL_DROP",
    "SESSIONS",
    "BytesProgress",
    "LoadOptions",
    "MiB",
    "RawRequests",
    "Trace",
    "TraceUnit",
    "chain_identities",
    "cut_partial_blocks",
    "dense_ids",
    "load_trace",
    "mix64",
    "parse_type_map",
    "parse_unit",
    "reorder_segments",
    "trace_from_records",
    "trace_units",
]
