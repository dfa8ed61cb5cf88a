"""A property-based fuzz test of every RPC of a real node with auth on: random credentials
(none, made-up, tenant, service, node, admin), random and half-valid messages, integer and
time fields out of range (varints past the field's width, NaN and infinite times, the largest
sequence number), and counts past the node's limits. Every call must end, within its
deadline, in a status a client can act on, on the same connection; the node must never crash,
hang or log an unexpected error."""

from __future__ import annotations

import math
import struct
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.auth import Role, add_principal
from kvstore.errors import InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import ucx_frames
from kvstore.wire.ucx_worker import ucx_available
from tests.kvstore.node_harness import make_shard, write_config

pytestmark = pytest.mark.timeout(300)
RPCS = (
    "PutShards",
    "GetShards",
    "ReadBatch",
    "Contains",
    "Delete",
    "Purge",
    "ListTombstones",
    "Stats",
    "Health",
    "TouchShards",
    "ListShards",
    "QueueRepair",
    *(["OpenUcxSession"] if ucx_available() else []),  # without UCX: UNAVAILABLE, by design
)
# What a well-behaved node answers to anything; INTERNAL, UNKNOWN and DEADLINE_EXCEEDED
# (a hang) are bugs.
EXPECTED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_TIMEOUT_S = 10.0  # a call unanswered this long is then checked for a hang (_answer)
HANG_PROBES = 10  # Health answers the node gives meanwhile that make it a hang
PROBE_PAUSE_S = 0.5
ANSWER_CAP_S = 120.0  # grpc's own deadline: far past any answer of a loaded node
_CALLS = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fuzz-call")

tenants = st.sampled_from(["", "acme", "globex", "x" * 300, "é\u0000"])
keys = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40)), max_size=5)
shards = st.one_of(
    st.binary(max_size=300),
    st.binary(min_size=1, max_size=200).map(make_shard),
)
times_s = st.one_of(
    st.floats(), st.sampled_from([0.0, -1.0, 1e300, 2.0**53, math.nan, math.inf, -math.inf])
)
groups = st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1))
# Values for integer fields, as varints: past uint32 and int64, the largest uint64, and the
# 10-byte encodings of negative numbers.
HUGE_VARINTS = st.sampled_from([2**32, 2**40, 2**63, 2**64 - 1, 2**64 - 2, 2**31])
# (field number, wire type) of each request's integer (varint, 0) and double (fixed64, 1)
# fields; appended last, they override what the message had.
SCALAR_FIELDS = {
    "PutShards": [(5, 1)],
    "ListTombstones": [(1, 0), (2, 0)],
    "ListShards": [(1, 0), (3, 0)],
}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def out_of_range(draw: st.DrawFn, rpc: str, raw: bytes) -> bytes:
    """``raw`` with one integer or double field set past its range."""
    number, wire_type = draw(st.sampled_from(SCALAR_FIELDS[rpc]))
    if wire_type == 0:
        return raw + _varint(number << 3) + _varint(draw(HUGE_VARINTS))
    value = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308]))
    return raw + _varint(number << 3 | 1) + struct.pack("<d", value)


@st.composite
def messages(draw: st.DrawFn, rpc: str) -> bytes:
    """Raw request bytes: garbage, or a message of the right type with hostile fields."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    if rpc == "PutShards":
        items = draw(
            st.lists(st.tuples(keys.map(lambda k: k[0] if k else b""), shards), max_size=4)
        )
        message = pb.PutShardsRequest(
            tenant=draw(tenants),
            traffic_class=draw(st.sampled_from(["chat", "agent", "", "nope"])),
            shards=[pb.ShardPut(key=k, shard=s, written_at_s=draw(times_s)) for k, s in items],
            expires_at_s=draw(times_s),
            repair=draw(st.booleans()),
        )
    elif rpc in ("GetShards", "ReadBatch"):
        message = pb.GetShardsRequest(
            tenant=draw(tenants), keys=draw(keys), version=draw(st.binary(max_size=20))
        )
    elif rpc == "Contains":
        message = pb.ContainsRequest(tenant=draw(tenants), keys=draw(keys))
    elif rpc == "Delete":
        message = pb.DeleteRequest(tenant=draw(tenants), keys=draw(keys))
    elif rpc == "Purge":
        message = pb.PurgeRequest(tenant=draw(tenants))
    elif rpc == "ListTombstones":
        after_seq = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([2**64 - 1, 2**63]))
        message = pb.ListTombstonesRequest(
            after_seq=draw(after_seq), limit=draw(st.integers(0, 2**32 - 1))
        )
    elif rpc == "TouchShards":
        touched = draw(keys)
        versions = draw(st.one_of(st.just([]), st.lists(st.binary(max_size=20), max_size=6)))
        message = pb.TouchShardsRequest(tenant=draw(tenants), keys=touched, versions=versions)
    elif rpc == "ListShards":
        message = pb.ListShardsRequest(
            group=draw(groups),
            start_after=draw(st.binary(max_size=60)),
            limit=draw(st.integers(0, 2**32 - 1)),
        )
    elif rpc == "QueueRepair":
        hints = draw(st.lists(st.tuples(tenants, keys, groups), max_size=4))
        message = pb.QueueRepairRequest(
            hints=[pb.RepairHint(tenant=t, key=k[0] if k else b"", group=g) for t, k, g in hints]
        )
    else:
        message = pb.StatsRequest() if rpc == "Stats" else pb.HealthRequest()
    raw = message.SerializeToString()
    if rpc in SCALAR_FIELDS and draw(st.booleans()):
        return draw(out_of_range(rpc, raw))
    return raw


def _call(channel: grpc.Channel, rpc: str, raw: bytes, metadata) -> grpc.StatusCode:
    return _answer(channel, rpc, raw, metadata)[0]


def _answer(channel: grpc.Channel, rpc: str, raw: bytes, metadata) -> tuple[grpc.StatusCode, str]:
    """The call's status and details; DEADLINE_EXCEEDED for a hang.

    A hang is a call still unanswered CALL_TIMEOUT_S on, while the node then answers
    HANG_PROBES Health calls one after another: the node gets CPU time and serves, but not
    this call. A loaded machine that keeps the node off the CPU delays the Health answers as
    well, and is no hang (a wall-clock timeout alone called it one)."""
    future = _CALLS.submit(_blocking_call, channel, rpc, raw, metadata)
    health = channel.unary_unary("/kvstore.v1.ShardStore/Health")
    probes = 0
    while not futures.wait([future], CALL_TIMEOUT_S if probes == 0 else PROBE_PAUSE_S).done:
        if probes == HANG_PROBES:
            details = f"no answer while the node answered {probes} Health calls"
            return grpc.StatusCode.DEADLINE_EXCEEDED, details
        health(pb.HealthRequest().SerializeToString(), timeout=ANSWER_CAP_S)
        probes += 1
    return future.result()


def _blocking_call(
    channel: grpc.Channel, rpc: str, raw: bytes, metadata
) -> tuple[grpc.StatusCode, str]:
    method = f"/kvstore.v1.ShardStore/{rpc}"
    try:
        if rpc == "ReadBatch":
            list(channel.unary_stream(method)(raw, timeout=ANSWER_CAP_S, metadata=metadata))
        else:
            channel.unary_unary(method)(raw, timeout=ANSWER_CAP_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _principals(credentials: Path) -> dict[str, str]:
    """Role name -> the token of a new principal of that role (tenant acme; the service
    acts for acme)."""
    return {
        "tenant": add_principal(credentials, "acme", Role.TENANT),
        "service": add_principal(credentials, "serving", Role.SERVICE, frozenset({"acme"})),
        "node": add_principal(credentials, "nodes", Role.NODE),
        "admin": add_principal(credentials, "admin", Role.ADMIN),
    }


def test_every_rpc_with_every_credential(tmp_path: Path, start_node) -> None:
    credentials = tmp_path / "credentials.toml"
    tokens = {**_principals(credentials), "made-up": "kvst_made-up", "empty": ""}
    config = write_config(tmp_path, credentials_file=str(credentials), max_batch_bytes=1 << 20)
    node = start_node(config)
    address = config.read_text().split('address = "')[1].split('"')[0]
    unexpected: list[tuple[str, str, grpc.StatusCode]] = []
    rpc_to_codes: dict[str, set[grpc.StatusCode]] = {rpc: set() for rpc in RPCS}

    with grpc.insecure_channel(address) as channel:

        @settings(
            max_examples=400,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            rpc = data.draw(st.sampled_from(RPCS))
            raw = data.draw(messages(rpc))
            who = data.draw(st.sampled_from([None, *tokens]))
            header = data.draw(
                st.sampled_from(["Bearer {}", "{}", "Basic {}", "Bearer  {}", "bearer {}"])
            )
            metadata = None if who is None else (("authorization", header.format(tokens[who])),)
            code = _call(channel, rpc, raw, metadata)
            rpc_to_codes[rpc].add(code)
            if code not in EXPECTED_CODES:
                unexpected.append((rpc, str(who), code))

        fuzz()
        health = channel.unary_unary("/kvstore.v1.ShardStore/Health")
        raw = pb.HealthRequest().SerializeToString()
        assert health(raw, timeout=ANSWER_CAP_S), "node stopped answering"
    assert not unexpected, f"calls ended in unexpected statuses (crash or hang): {unexpected[:5]}"
    never = [rpc for rpc, codes in rpc_to_codes.items() if not codes]
    assert not never, f"the fuzz never called {never}"
    assert node.proc is not None and node.proc.poll() is None, "the node process died"
    log_text = node.log_path.read_text()
    for marker in ("Traceback", "never retrieved", "failed"):
        assert marker not in log_text, f"the node logged {marker!r}:\n{log_text[-3000:]}"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(frame=st.one_of(st.binary(max_size=300), st.binary(max_size=90).map(lambda b: b"KVRS" + b)))
def test_ucx_request_frames_parse_or_are_refused(frame: bytes) -> None:
    """The UCX read request's parser (reached by anyone who can send to the node's worker)."""
    try:
        decoded = ucx_frames.decode_request(frame)
    except InvalidArgument:
        return
    assert len(decoded.session_id) == 16 and decoded.request.HasField("ucx")
    assert not decoded.signed_with(bytes(32)), "a made-up frame passed as signed"


KEY = b"k" * 16
SHARD = make_shard(b"role table")
# A well-formed request of each RPC, and the roles that may make it (kvstore/auth.py's table;
# the others get PERMISSION_DENIED). Health is open to everyone.
ROLE_TABLE: dict[str, tuple[Message, frozenset[str]]] = {
    "PutShards": (
        pb.PutShardsRequest(
            tenant="acme", traffic_class="chat", shards=[pb.ShardPut(key=KEY, shard=SHARD)]
        ),
        frozenset({"tenant", "service"}),
    ),
    "RepairPut": (
        pb.PutShardsRequest(
            tenant="acme",
            traffic_class="chat",
            shards=[pb.ShardPut(key=KEY, shard=SHARD)],
            repair=True,
        ),
        # A node's repair put re-creates only a version its group holds, and this node has no
        # group-mates that hold one (tests/client/test_node_trust.py has the node's case).
        frozenset({"tenant", "service"}),
    ),
    "GetShards": (
        pb.GetShardsRequest(tenant="acme", keys=[KEY]),
        frozenset({"tenant", "service", "node"}),
    ),
    "ReadBatch": (
        pb.GetShardsRequest(tenant="acme", keys=[KEY]),
        frozenset({"tenant", "service", "node"}),
    ),
    "Contains": (pb.ContainsRequest(tenant="acme", keys=[KEY]), frozenset({"tenant", "service"})),
    "TouchShards": (
        pb.TouchShardsRequest(tenant="acme", keys=[KEY]),
        frozenset({"tenant", "service"}),
    ),
    "QueueRepair": (
        pb.QueueRepairRequest(hints=[pb.RepairHint(tenant="acme", key=KEY, group=0)]),
        frozenset({"tenant", "service", "node"}),
    ),
    "Delete": (pb.DeleteRequest(tenant="acme", keys=[KEY]), frozenset({"tenant", "service"})),
    "ListShards": (pb.ListShardsRequest(group=0), frozenset({"node", "admin"})),
    "ListTombstones": (pb.ListTombstonesRequest(), frozenset({"node", "admin"})),
    "Stats": (pb.StatsRequest(), frozenset({"node", "admin"})),
    "Purge": (pb.PurgeRequest(tenant="globex"), frozenset({"admin"})),
    "Health": (pb.HealthRequest(), frozenset({"tenant", "service", "node", "admin"})),
    "OpenUcxSession": (pb.UcxSessionRequest(), frozenset({"tenant", "service"})),
}


def test_each_rpc_answers_exactly_the_roles_of_the_table(tmp_path: Path, start_node) -> None:
    credentials = tmp_path / "credentials.toml"
    tokens = _principals(credentials)
    config = write_config(tmp_path, credentials_file=str(credentials))
    start_node(config)
    address = config.read_text().split('address = "')[1].split('"')[0]
    wrong: list[str] = []
    with grpc.insecure_channel(address) as channel:
        health = channel.unary_unary(
            "/kvstore.v1.ShardStore/Health",
            request_serializer=pb.HealthRequest.SerializeToString,
            response_deserializer=pb.HealthReply.FromString,
        )
        deadline_s = time.monotonic() + 60
        while not health(pb.HealthRequest(), timeout=ANSWER_CAP_S).repair_ready:
            assert time.monotonic() < deadline_s, "a node with no peers never became repair-ready"
            time.sleep(0.05)
        for name, (request, allowed) in ROLE_TABLE.items():
            rpc = "PutShards" if name == "RepairPut" else name
            for role, token in tokens.items():
                metadata = (("authorization", f"Bearer {token}"),)
                code = _call(channel, rpc, request.SerializeToString(), metadata)
                want = grpc.StatusCode.OK if role in allowed else grpc.StatusCode.PERMISSION_DENIED
                if name == "OpenUcxSession" and role in allowed and not ucx_available():
                    want = grpc.StatusCode.UNAVAILABLE  # a node without UCX opens no session
                if code != want:
                    wrong.append(f"{name} as {role}: {code.name}, expected {want.name}")
    assert not wrong, "the node's role checks differ from kvstore/auth.py's table: " + "; ".join(
        wrong
    )


def _code_and_details(channel: grpc.Channel, rpc: str, message: Message, token: str):
    metadata = (("authorization", f"Bearer {token}"),)
    return _answer(channel, rpc, message.SerializeToString(), metadata)


def test_out_of_range_fields_are_refused_naming_the_field(tmp_path: Path, start_node) -> None:
    """The audit's inputs: a 66,000-hint QueueRepair, ListTombstones after the largest
    sequence number, a group past the map, times that are no times."""
    credentials = tmp_path / "credentials.toml"
    tokens = _principals(credentials)
    config = write_config(tmp_path, credentials_file=str(credentials))
    start_node(config)
    address = config.read_text().split('address = "')[1].split('"')[0]
    hint = pb.RepairHint(tenant="acme", key=KEY, group=0)
    put = pb.ShardPut(key=KEY, shard=SHARD)
    cases = {
        "hints": ("QueueRepair", pb.QueueRepairRequest(hints=[hint] * 66_000), "tenant"),
        "hints[0].group": (
            "QueueRepair",
            pb.QueueRepairRequest(hints=[pb.RepairHint(tenant="acme", key=KEY, group=2**32 - 1)]),
            "tenant",
        ),
        "group": ("ListShards", pb.ListShardsRequest(group=2**32 - 1), "node"),
        "expires_at_s": (
            "PutShards",
            pb.PutShardsRequest(traffic_class="chat", shards=[put], expires_at_s=math.nan),
            "tenant",
        ),
        "shards[0].written_at_s": (
            "PutShards",
            pb.PutShardsRequest(
                traffic_class="chat", shards=[pb.ShardPut(key=KEY, shard=SHARD, written_at_s=-1)]
            ),
            "tenant",
        ),
    }
    with grpc.insecure_channel(address) as channel:
        health = channel.unary_unary(
            "/kvstore.v1.ShardStore/Health",
            request_serializer=pb.HealthRequest.SerializeToString,
            response_deserializer=pb.HealthReply.FromString,
        )
        deadline_s = time.monotonic() + 60
        while not health(pb.HealthRequest(), timeout=ANSWER_CAP_S).repair_ready:
            assert time.monotonic() < deadline_s, "a node with no peers never became repair-ready"
            time.sleep(0.05)
        for field, (rpc, message, role) in cases.items():
            code, details = _code_and_details(channel, rpc, message, tokens[role])
            assert code is grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {code.name} {details}"
            named = f"{len(message.hints)} hints" if field == "hints" else field
            assert details.startswith(named), f"the error does not name {field!r}: {details}"
        last = pb.ListTombstonesRequest(after_seq=2**64 - 1)
        assert _code_and_details(channel, "ListTombstones", last, tokens["node"])[0] is (
            grpc.StatusCode.OK
        ), "ListTombstones after the largest sequence number must answer an empty page"
        reply = health(pb.HealthRequest(), timeout=ANSWER_CAP_S)
        assert reply.serving, "the connection or node broke"
