"""Membership on etcd: the cluster map and the live nodes, for nodes, clients and the CLI.

Keys under ``[membership] prefix`` (default ``/kvstore``)::

    <prefix>/map             the cluster map, as cluster.toml text (kvstore/config.py); its
                             epoch only grows; every change is a compare-and-swap on the
                             key's mod revision, so two writers never both win
    <prefix>/members/<id>    JSON {"address", "pid", "incarnation"}, put under the node's lease
                             (TTL lease_ttl_s, refreshed every third of it): present = up

Every node and client watches ``<prefix>/map`` and switches to a newer epoch without a restart
(:meth:`EtcdMembership.watch_map`); a watch that breaks is re-made after a fresh read, and the
map is read again every ``lease_ttl_s`` anyway, so a lost event costs at most that long.
The map's changes themselves are pure functions (kvstore/map_changes.py).

TLS (``[membership] ca_file``): every etcd client here (nodes, clients' map followers, the
``kvstore cluster`` commands) talks TLS to etcd and presents an etcd client certificate:
``cert_file`` (nodes and operators: they change the map and register) or ``reader_cert_file``
(clients: they only read it). A local cluster's etcd (deploy/local_etcd.py) trusts a CA of
its own, so no kvstore certificate reaches it, and enables etcd's RBAC so each certificate's
common name is a user with just those rights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd.watcher import Watcher

from kvstore.config import ClusterConfig, MembershipConfig, cluster_from_toml, cluster_to_toml
from kvstore.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

ETCD_TIMEOUT_S = 5
RETRY_S = 1.0
WATCH_CANCEL_S = 1.0  # the longest a watch's cancel is waited for (it may never answer)
MAX_CAS_ATTEMPTS = 20


class EtcdMembership:
    """One etcd connection for one cluster's keys (see the module docstring)."""

    def __init__(self, membership: MembershipConfig, *, reader: bool = False) -> None:
        if not membership.endpoints:
            raise InvalidArgument("[membership] etcd is empty: there is no etcd to talk to")
        self.membership = membership
        self._reader = reader  # a client following the map: its reader certificate, if any
        self._endpoint = 0  # the endpoint in use; one client per endpoint, made on first use
        self._clients: dict[int, aetcd.Client] = {}
        self._map_key = f"{membership.prefix}/map".encode()
        self._members_prefix = f"{membership.prefix}/members/".encode()
        # None until the first call; False from the first call no endpoint answered (logged
        # once per outage, counted in num_outages) until one answers again.
        self.reachable: bool | None = None
        self.num_outages = 0

    async def __aenter__(self) -> EtcdMembership:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def _client(self) -> aetcd.Client:
        if self._endpoint not in self._clients:
            endpoint = self.membership.endpoints[self._endpoint]
            self._clients[self._endpoint] = _client_for(endpoint, self.membership, self._reader)
        return self._clients[self._endpoint]

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

    async def _call(self, request: Callable[[aetcd.Client], Awaitable[Any]]) -> Any:
        """``request`` on the current endpoint; an endpoint that does not answer is left for
        the next one of ``[membership] etcd`` (each tried once). Unavailable if none does."""
        endpoints = self.membership.endpoints
        for _ in endpoints:
            try:
                reply = await request(self._client)
            except _UNREACHABLE as exc:
                # Other tasks may have calls in flight on this client: it stays open, and
                # comes back into use when the rotation returns to it.
                log.debug("etcd %s: %s", endpoints[self._endpoint], exc)
                self._endpoint = (self._endpoint + 1) % len(endpoints)
            except aetcd.exceptions.ClientError as exc:
                raise Unavailable(f"etcd {endpoints[self._endpoint]}: {exc}") from None
            else:
                self._answered()
                return reply
        error = Unavailable(f"no etcd endpoint of {self.membership.etcd} answers")
        self._unreachable(error)
        raise error

    def _answered(self) -> None:
        if self.reachable is False:
            log.warning("etcd %s answers again", self.membership.etcd)
        self.reachable = True

    def _unreachable(self, error: Unavailable) -> None:
        """Log an outage once, when it starts (every caller retries meanwhile)."""
        if self.reachable is not False:
            self.num_outages += 1
            log.warning("%s; retrying (logged once per outage)", error)
        self.reachable = False

    async def get_map(self) -> tuple[ClusterConfig, int] | None:
        """The map in etcd and its key's mod revision, or None when none was stored yet."""
        got = await self._call(lambda c: c.get(self._map_key))
        if got is None:
            return None
        source = f"etcd {self.membership.etcd} {self._map_key.decode()}"
        return cluster_from_toml(got.value.decode(), source), got.mod_revision

    async def create_map(self, cfg: ClusterConfig) -> ClusterConfig:
        """Store ``cfg`` unless a map is there already; return the map etcd holds."""
        txn = self._client.transactions
        await self._call(
            lambda c: c.transaction(
                compare=[txn.version(self._map_key) == 0],
                success=[txn.put(self._map_key, cluster_to_toml(cfg).encode())],
                failure=[],
            )
        )
        got = await self.get_map()
        assert got is not None, "etcd lost the map it just stored"
        return got[0]

    async def change_map(self, change: Callable[[ClusterConfig], ClusterConfig]) -> ClusterConfig:
        """Apply ``change`` to the current map and store the result, compare-and-swap; a
        concurrent writer makes it read again and retry. ``change`` may raise to refuse."""
        txn = self._client.transactions
        for _ in range(MAX_CAS_ATTEMPTS):
            got = await self.get_map()
            if got is None:
                raise InvalidArgument(
                    f"no cluster map in etcd {self.membership.etcd} under "
                    f"{self.membership.prefix}; start the cluster with `kvstore cluster up --etcd`"
                )
            current, revision = got
            new = change(current)
            if new.epoch <= current.epoch:
                raise InvalidArgument(f"a map change must raise the epoch ({current.epoch})")
            put = txn.put(self._map_key, cluster_to_toml(new).encode())
            won, _ = await self._call(
                lambda c, revision=revision, put=put: c.transaction(
                    compare=[txn.mod(self._map_key) == revision], success=[put], failure=[]
                )
            )
            if won:
                log.info("cluster map epoch %d -> %d", current.epoch, new.epoch)
                return new
        raise Unavailable(f"the cluster map changed {MAX_CAS_ATTEMPTS} times under us; retry")

    async def watch_map(self) -> AsyncIterator[ClusterConfig]:
        """The current map, then every map with a higher epoch, forever (see module doc)."""
        epoch = -1
        while True:
            try:
                got = await self.get_map()
                if got is not None and got[0].epoch > epoch:
                    epoch = got[0].epoch
                    yield got[0]
                start = got[1] + 1 if got is not None else None
                watch = await self._call(
                    lambda c, start=start: c.watch(self._map_key, start_revision=start)
                )
                try:
                    async for cfg in self._watched(watch):
                        if cfg.epoch > epoch:
                            epoch = cfg.epoch
                            yield cfg
                finally:
                    ending = await _bounded(watch.cancel(), WATCH_CANCEL_S)
                    if ending.done() and not ending.cancelled():
                        ending.exception()  # retrieved: a failed cancel is ignored
            except Unavailable as exc:  # an outage: logged once when it began
                log.debug("watching the cluster map: %s; reading it again", exc)
                await asyncio.sleep(RETRY_S)
            except aetcd.exceptions.ClientError as exc:  # the watch broke: read again
                log.info("watching the cluster map: %s; reading it again", exc)
                await asyncio.sleep(RETRY_S)
            except ValueError as exc:
                log.warning("etcd holds a cluster map that does not parse: %s", exc)
                await asyncio.sleep(RETRY_S)

    async def _watched(self, watch: Any) -> AsyncIterator[ClusterConfig]:
        """Maps from a watch's events; ends after ``lease_ttl_s`` without one (a re-read).

        Each event is awaited as a task that is cancelled, not waited for, when the wait
        ends: aetcd's watch iterator does not always end on a cancel, and ``wait_for`` then
        waits for it for ever (a client's close hung so, about one in four times, right after
        a map change). Closing the etcd client ends it.
        """
        events = watch.__aiter__()
        while True:
            step = await _bounded(events.__anext__(), self.membership.lease_ttl_s)
            if step.cancelled() or not step.done():
                return
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            if event.kind == "PUT":
                yield cluster_from_toml(event.kv.value.decode(), "etcd watch event")

    async def live_members(self) -> dict[str, dict[str, Any]]:
        """Node id -> what it registered, for every node whose lease is alive."""
        got = await self._call(lambda c: c.get_prefix(self._members_prefix))
        return {kv.key[len(self._members_prefix) :].decode(): json.loads(kv.value) for kv in got}

    async def keep_registered(self, node_id: str, info: dict[str, Any]) -> None:
        """Register ``node_id`` under a lease and keep it alive until cancelled; a lost lease
        (etcd down longer than the TTL) is replaced by a new one. Revoked on cancel."""
        ttl_s = int(self.membership.lease_ttl_s)
        key = self._members_prefix + node_id.encode()
        lease_id = None
        try:
            while True:
                try:
                    if lease_id is None:
                        lease = await self._call(lambda c: c.lease(ttl_s))
                        lease_id = lease.id
                        await self._call(
                            lambda c, i=lease_id: c.put(key, json.dumps(info).encode(), lease=i)
                        )
                        log.info("registered %s in etcd (lease %x, %d s)", node_id, lease_id, ttl_s)
                    else:
                        reply = await self._call(lambda c, i=lease_id: c.refresh_lease(i))
                        if reply is None or reply.TTL <= 0:
                            lease_id = None  # expired meanwhile: register again
                            continue
                except Unavailable as exc:  # an outage is logged once, by _call
                    log.debug("etcd lease of %s: %s; retrying", node_id, exc)
                    lease_id = None
                await asyncio.sleep(ttl_s / 3)
        finally:
            if lease_id is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._client.revoke_lease(lease_id), 2.0)


def _client_for(endpoint: str, membership: MembershipConfig, reader: bool) -> aetcd.Client:
    host, _, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
    host = host or "127.0.0.1"
    if not membership.ca_file:
        return aetcd.Client(host=host, port=int(port), timeout=ETCD_TIMEOUT_S)
    return TlsEtcdClient(host, int(port), etcd_credentials(membership, reader))


def etcd_credentials(membership: MembershipConfig, reader: bool = False) -> grpc.ChannelCredentials:
    """TLS credentials for etcd: its CA, and this host's etcd client certificate if set (a
    ``reader``'s, if it has one of its own)."""
    cert, key = membership.cert_file, membership.key_file
    if reader and membership.reader_cert_file:
        cert, key = membership.reader_cert_file, membership.reader_key_file

    def read(path: str) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise InvalidArgument(f"[membership] cannot read {path}: {exc}") from None

    return grpc.ssl_channel_credentials(read(membership.ca_file), read(key), read(cert))


class TlsEtcdClient(aetcd.Client):
    """aetcd's client over TLS: aetcd 1.0 opens plaintext channels only, so :meth:`connect` is
    aetcd's own with a TLS channel (etcd checks the client certificate: client-cert-auth)."""

    def __init__(self, host: str, port: int, credentials: grpc.ChannelCredentials) -> None:
        super().__init__(host=host, port=port, timeout=ETCD_TIMEOUT_S)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it, as aetcd does
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
            self._connected.set()
        finally:
            self._is_connecting = False


_UNREACHABLE = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)


async def follow_map(
    membership: EtcdMembership, epoch: int, apply: Callable[[ClusterConfig], None]
) -> None:
    """Call ``apply`` with each map from etcd whose epoch is above ``epoch``, forever (nodes
    and clients switch epochs this way, without a restart)."""
    async for cfg in membership.watch_map():
        if cfg.epoch > epoch:
            epoch = cfg.epoch
            apply(cfg)


async def _bounded(call: Awaitable[Any], timeout_s: float) -> asyncio.Future[Any]:
    """``call`` as a task, awaited for at most ``timeout_s`` and cancelled past that (or when
    the caller is) without waiting for it: ``wait_for`` would wait for a call that ignores a
    cancel. The caller reads the task's outcome."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()
    return task
