"""``kvstore get|put|del|ttl|inspect KEY``: one key of a cluster, as redis-cli shows one.

::

    kvstore put greeting "hello" [--class chat] [--ttl 1h]     # or --file PATH (- = stdin)
    kvstore get greeting [--out PATH]                         # the bytes; exit 1 on a miss
    kvstore ttl greeting                                      # how long it still lives
    kvstore inspect greeting                                  # each node of its group
    kvstore del greeting [more keys]
    every command: [--cluster DIR/cluster.toml] [--tenant T] [--token-file PATH] [--hex]
                   [--timeout 5s] [--json PATH]

The cluster is ``--cluster`` (a cluster.toml or its directory) or ``$KVSTORE_CLUSTER``; the
tenant ``--tenant``, else ``$KVSTORE_TENANT``, else ``default``; the token ``--token-file``,
else ``$KVSTORE_TOKEN`` or the file ``$KVSTORE_TOKEN_FILE`` names (kvstore/auth.py). A KEY is
a string, hashed exactly as the Python client hashes a ``str`` key (client/keys.py
``string_key``: xxh3-128 under a fixed namespace), or with ``--hex`` the 16-byte key itself
in 32 hex digits (a ``block_keys`` key, as logs print them).

``get`` writes the block to ``--out`` (``-`` = standard output), else to standard output when
that is not a terminal, else prints it as text when it is UTF-8 (or says how many bytes of
binary there are). ``ttl`` and ``inspect`` read each node's record of the key
(``InspectShards``: not an access, no TTL refreshed); ``inspect`` then reads the block back
through the client, which is a read: it refreshes the TTL as any read hit does
(``--no-read-back`` leaves it). Times are the cluster's clock (virtual with a time scale).
Exit status: 0, or 1 on a miss or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import math
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from client.keys import string_key
from client.kv_client import KVClient
from kvstore.auth import read_token_file
from kvstore.cli.args import duration_arg, is_stdout, write_json
from kvstore.cli.tables import make_console, print_fitted
from kvstore.config import KEY_BYTES
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied
from kvstore.proto import kvstore_pb2 as pb
from ttl.units import format_bytes, format_duration

TENANT_ENV = "KVSTORE_TENANT"
DEFAULT_TENANT = "default"
Document = dict[str, Any]


def _add_common(parser: argparse.ArgumentParser, *, many: bool = False) -> None:
    if many:
        parser.add_argument("keys", nargs="+", metavar="KEY", help="the keys (strings, or --hex)")
    else:
        parser.add_argument("key", metavar="KEY", help="the key: a string, or with --hex 32 hex")
    parser.add_argument("--hex", action="store_true", help="KEY is the 16-byte key in hex")
    parser.add_argument("--cluster", required=True, type=Path, help="the cluster")
    parser.add_argument(
        "--tenant",
        default=os.environ.get(TENANT_ENV, DEFAULT_TENANT),
        help=f"the tenant whose key it is (default: ${TENANT_ENV}, else {DEFAULT_TENANT!r})",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help="file holding this tenant's token (default: $KVSTORE_TOKEN, $KVSTORE_TOKEN_FILE)",
    )
    parser.add_argument("--timeout", type=duration_arg, default=5.0, help="per call, e.g. 30s")
    parser.add_argument("--json", type=Path, help="write the result as JSON here")


def key_bytes(text: str, as_hex: bool) -> bytes:
    """The store key a command line names (see the module docstring)."""
    if not as_hex:
        return string_key(text)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"--hex keys are {2 * KEY_BYTES} hex digits, got {text!r}")
    return key


def _run(args: argparse.Namespace, command: Callable[[KVClient], Awaitable[Document]]) -> int:
    """Connect, run ``command``, write its JSON; exit status 1 when it reports a miss."""

    async def connected() -> Document:
        token = read_token_file(args.token_file) if args.token_file else None
        async with KVClient.connect(args.cluster, args.tenant, token) as kv:
            return await command(kv)

    document = asyncio.run(connected())
    if args.json is not None:
        write_json(document, args.json)
    return 0 if document.get("found", True) else 1


def _key_record(args: argparse.Namespace, key: bytes) -> Document:
    return {"key": args.key, "key_hex": key.hex(), "tenant": args.tenant}


# get ---------------------------------------------------------------------------------------


def configure_get(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore get``."""
    _add_common(parser)
    parser.add_argument(
        "--out", type=Path, help="write the bytes here (- = standard output, even a terminal)"
    )


def run_get(args: argparse.Namespace) -> int:
    key = key_bytes(args.key, args.hex)

    async def get(kv: KVClient) -> Document:
        block = await kv.get(key, timeout_s=args.timeout)
        document = {**_key_record(args, key), "found": block is not None}
        if block is None:
            print(f"(miss) no block under {args.key!r} for tenant {args.tenant!r}", file=sys.stderr)
            return document
        _show_block(block, args)
        document.update(bytes=len(block), value_base64=base64.b64encode(block).decode())
        return document

    return _run(args, get)


def _show_block(block: bytes, args: argparse.Namespace) -> None:
    if args.out is None and is_stdout(args.json):
        return  # standard output is the JSON's, which holds the value
    if args.out is not None and str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(block)
        print(f"wrote {len(block)} bytes to {args.out}", file=sys.stderr)
        return
    if args.out is not None or not sys.stdout.isatty():
        sys.stdout.flush()
        sys.stdout.buffer.write(block)
        sys.stdout.flush()
        return
    try:
        print(block.decode())
    except UnicodeDecodeError:
        print(f"({len(block)} bytes of binary; --out PATH writes them)")


# put ---------------------------------------------------------------------------------------


def configure_put(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore put``."""
    _add_common(parser)
    parser.add_argument("value", nargs="?", help="the value, stored as UTF-8 (or --file)")
    parser.add_argument("--file", type=Path, help="store this file's bytes (- = standard input)")
    parser.add_argument(
        "--class", dest="traffic_class", default="chat", help="traffic class (its TTL applies)"
    )
    parser.add_argument(
        "--ttl",
        type=duration_arg,
        help="the block's own TTL, e.g. 1h: shorter than its class's (never longer, nor past "
        "the tenant's cap); from its last access, as every TTL (default: the class's)",
    )


def run_put(args: argparse.Namespace) -> int:
    key = key_bytes(args.key, args.hex)
    data = _value(args)

    async def put(kv: KVClient) -> Document:
        await kv.put(key, data, args.traffic_class, ttl_s=args.ttl, timeout_s=args.timeout)
        ttl = f"its own TTL {format_duration(args.ttl)}" if args.ttl else "the class TTL"
        print(f"stored {len(data)} bytes under {args.key!r} ({args.traffic_class}, {ttl})")
        return {
            **_key_record(args, key),
            "bytes": len(data),
            "traffic_class": args.traffic_class,
            "ttl_s": args.ttl,
        }

    return _run(args, put)


def _value(args: argparse.Namespace) -> bytes:
    if (args.value is None) == (args.file is None):
        raise InvalidArgument("give the value: kvstore put KEY VALUE, or --file PATH (- = stdin)")
    if args.file is None:
        return args.value.encode()
    return sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()


# del ---------------------------------------------------------------------------------------


def configure_delete(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore del``."""
    _add_common(parser, many=True)


def run_delete(args: argparse.Namespace) -> int:
    keys = [key_bytes(text, args.hex) for text in args.keys]

    async def delete(kv: KVClient) -> Document:
        await kv.delete(keys, timeout_s=args.timeout)
        print(f"deleted {len(keys)} key{'s' if len(keys) != 1 else ''} of tenant {args.tenant!r}")
        return {
            "keys": args.keys,
            "keys_hex": [key.hex() for key in keys],
            "tenant": args.tenant,
            "deleted": True,
        }

    return _run(args, delete)


# ttl and inspect: every node's record of the key -------------------------------------------


async def inspect_nodes(kv: KVClient, key: bytes, timeout_s: float) -> list[Document]:
    """Each node of ``key``'s group, in shard position order, with its shards of the key."""
    group = kv.config.groups[kv.placement.group_index(key)]
    request = pb.InspectShardsRequest(tenant=kv.tenant, keys=[key])
    replies = await asyncio.gather(
        *(kv.conns[node].call("InspectShards", request, timeout_s) for node in group),
        return_exceptions=True,
    )
    return [
        _node_record(position, node, reply)
        for position, (node, reply) in enumerate(zip(group, replies, strict=True))
    ]


def _node_record(position: int, node: str, reply: Any) -> Document:
    record: Document = {"node": node, "position": position, "up": True}
    if isinstance(reply, KVStoreError):
        return {**record, "up": False, "error": str(reply), "shards": []}
    if isinstance(reply, BaseException):
        raise reply
    record["now_s"] = reply.now_s
    record["shards"] = [
        {
            "version": s.version.hex(),
            "shard_index": s.shard_index,
            "shard_bytes": s.shard_bytes,
            "traffic_class": s.traffic_class,
            "written_at_s": s.written_at_s,
            "last_access_s": s.last_access_s,
            "expires_at_s": _json_time(s.expires_at_s),
            "checksum": "ok" if s.status == pb.ShardStatus.HIT else "corrupt",
        }
        for s in reply.results[0].shards
    ]
    return record


def _json_time(seconds: float) -> float | None:
    return None if math.isinf(seconds) else seconds  # JSON has no inf: null = never


def block_life(nodes: list[Document], k: int) -> Document | None:
    """The newest version with at least ``k`` intact shards: its version, when it stops being
    readable (its k-th latest shard expiry; None = never), its TTL from last access."""
    version_to_shards: dict[str, list[Document]] = {}
    for node in nodes:
        for shard in node["shards"]:
            if shard["checksum"] == "ok":
                version_to_shards.setdefault(shard["version"], []).append(shard)
    readable = [shards for shards in version_to_shards.values() if len(shards) >= k]
    if not readable:
        return None
    shards = max(readable, key=lambda s: (max(x["written_at_s"] for x in s), s[0]["version"]))
    expiries = sorted((_expiry(s) for s in shards), reverse=True)
    expires_at_s = expiries[k - 1]
    newest = max(shards, key=lambda s: s["last_access_s"])
    return {
        "version": shards[0]["version"],
        "shards": len(shards),
        "expires_at_s": _json_time(expires_at_s),
        "block_ttl_s": _json_time(_expiry(newest) - newest["last_access_s"]),
        "traffic_class": shards[0]["traffic_class"],
    }


def _expiry(shard: Document) -> float:
    return math.inf if shard["expires_at_s"] is None else shard["expires_at_s"]


def _now_s(nodes: list[Document]) -> float | None:
    return next((n["now_s"] for n in nodes if n["up"]), None)


def configure_ttl(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore ttl``."""
    _add_common(parser)


def run_ttl(args: argparse.Namespace) -> int:
    key = key_bytes(args.key, args.hex)

    async def ttl(kv: KVClient) -> Document:
        nodes = await inspect_nodes(kv, key, args.timeout)
        life = block_life(nodes, kv.config.codec.k)
        now_s = _now_s(nodes)
        document = {**_key_record(args, key), "found": life is not None, "now_s": now_s}
        if life is None or now_s is None:
            print(f"(miss) no readable block under {args.key!r}", file=sys.stderr)
            return document
        expires_at_s = life["expires_at_s"]
        left_s = None if expires_at_s is None else expires_at_s - now_s
        document.update(life, ttl_s=left_s)
        if left_s is None:
            print(f"{args.key!r}: never expires ({life['traffic_class']})")
        else:
            print(
                f"{args.key!r}: {_duration(left_s)} left, expires {_when(expires_at_s)}; "
                f"TTL {_duration(life['block_ttl_s'])} from each access ({life['traffic_class']})"
            )
        return document

    return _run(args, ttl)


def configure_inspect(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore inspect``."""
    _add_common(parser)
    parser.add_argument(
        "--no-read-back",
        action="store_true",
        help="do not read the block back (a read refreshes its TTL)",
    )


def run_inspect(args: argparse.Namespace) -> int:
    key = key_bytes(args.key, args.hex)

    async def inspect(kv: KVClient) -> Document:
        nodes = await inspect_nodes(kv, key, args.timeout)
        life = block_life(nodes, kv.config.codec.k)
        document = {
            **_key_record(args, key),
            "group": kv.placement.group_index(key),
            "k": kv.config.codec.k,
            "now_s": _now_s(nodes),
            "nodes": nodes,
            "block": life,
            "found": life is not None,
        }
        if not args.no_read_back:
            try:
                block = await kv.get(key, timeout_s=args.timeout)
            except PermissionDenied:  # an admin's credential sees records, reads no data
                block, document["read_back_refused"] = None, True
            document["reads_back"] = block is not None
            document["block_bytes"] = None if block is None else len(block)
            if not document.get("read_back_refused"):
                document["found"] = block is not None
        _print_inspection(document)
        return document

    return _run(args, inspect)


def _print_inspection(document: Document) -> None:
    now_s = document["now_s"]
    table = Table(
        title=f"key {document['key']!r} = {document['key_hex']}, tenant {document['tenant']!r}, "
        f"group {document['group']}"
    )
    columns = ("node", "shard", "present", "version", "size", "class", "written", "expires")
    for column in (*columns, "checksum"):
        table.add_column(column, justify="right" if column in ("shard", "size") else "left")
    for node in document["nodes"]:
        if not node["up"]:
            down = "[red]node down[/red]"
            table.add_row(node["node"], str(node["position"]), down, node["error"])
            continue
        if not node["shards"]:
            table.add_row(node["node"], str(node["position"]), "no")
        for shard in node["shards"]:
            table.add_row(
                node["node"],
                str(shard["shard_index"]),
                "yes",
                shard["version"][:8],
                format_bytes(shard["shard_bytes"]),
                shard["traffic_class"],
                _ago(shard["written_at_s"], now_s),
                _until(shard["expires_at_s"], now_s),
                "ok" if shard["checksum"] == "ok" else "[red]corrupt[/red]",
            )
    console = make_console()
    print_fitted(table, console, keep=("present", "checksum"))
    life = document["block"]
    if life is None:
        print(f"no version has {document['k']} intact shards: the block is not readable")
    else:
        print(
            f"version {life['version'][:8]}: {life['shards']} intact shards (k = {document['k']})"
            f", readable until {_when(life['expires_at_s'])}"
        )
    if document.get("read_back_refused"):
        print("reads back: not tried (this credential may not read the tenant's data)")
    elif "reads_back" in document:
        got = document["block_bytes"]
        print(f"reads back: {'yes, ' + format_bytes(got) if got is not None else 'NO'}")


def _when(at_s: float | None) -> str:
    if at_s is None:
        return "never"
    moment = datetime.datetime.fromtimestamp(at_s, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(at_s: float, now_s: float | None) -> str:
    return _when(at_s) if now_s is None else f"{_duration(now_s - at_s)} ago"


def _until(at_s: float | None, now_s: float | None) -> str:
    if at_s is None or now_s is None:
        return _when(at_s)
    return f"in {_duration(at_s - now_s)}"


def _duration(seconds: float | None) -> str:
    """A duration as people read it: its two largest units ("6d 23h", "4m 10s", "0.3s")."""
    if seconds is None or math.isinf(seconds):
        return "never"
    if seconds < 60:
        return f"{seconds:.1f}s"
    parts, left = [], int(seconds)
    for unit, unit_s in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= unit_s or parts:
            parts.append((left // unit_s, unit))
            left %= unit_s
    return " ".join(f"{n}{unit}" for n, unit in parts[:2] if n)
