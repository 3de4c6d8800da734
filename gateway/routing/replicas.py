"""Gateway replicas that route as one: each tells the others what it sent where.

Replicas share the block index through Redis already (every one mirrors the
workers' block sets), but three other things lived in one process only:

- in-flight load: requests a gateway sent that a worker's heartbeat does not
  show yet (bounded load then let each replica pile its own share onto the
  same worker), and requests that finished since that heartbeat (each
  replica took only its own finishes off the heartbeat's counts, so a worker
  looked busy with requests the other replicas had seen end);
- speculative entries: the blocks a worker is about to hold because a
  request was just sent there (a sibling arriving at another replica before
  the cache events land went elsewhere);
- sessions: which worker a conversation last used.

So every replica appends to one Redis stream, ``{ns}:routes``, one stream
entry per flush: ``g`` (the replica's id) and ``b``, a msgpack list of the
entries below, each a map of the fields named (entries of one field each, as
replicas before 6 December 2026 wrote them, are read too):

- a *route* entry per routed request (``w`` worker, ``s`` hashed session key,
  ``c`` the prompt's block chain as packed little-endian u64, ``t`` seconds to
  hold it, ``p`` the last block of its longest cached prefix, decimal): the
  others speculate the chain on that worker, pin the session there and count
  the request in that prefix's demand (``gateway.routing.prefix_demand``);
- a *settle* entry (``w``, ``c``, ``t``; no ``s``) when that request's first
  token came (``t`` = the grace) or its worker failed it (``t`` = 0: withdrawn),
  so every replica holds a queued request's chain exactly as long as its own
  router does;
- a *loads* entry (``l``: JSON ``{worker: [inflight, pending, pending prefill
  tokens]}``, this replica's whole in-flight view, at least every
  ``KEEPALIVE_S``; or ``d``, the same for only the workers whose counts
  changed since its previous loads entry, zeros for none left; ``f``: JSON
  ``{worker: requests}`` that finished there since its previous loads entry)
  when its counts changed, at most every ``FLUSH_S``. A peer's whole view
  replaces its previous one and a changes entry updates it; one not refreshed
  for ``PEER_TTL_S`` is dropped, so a replica that died stops counting within
  seconds. (Every flush used to carry the whole view: with 1,000 busy workers
  22 KB of JSON, 0.5 ms to write and 0.8 ms for each peer to apply, up to 500
  times a second.) The others' views are summed as they change, not per
  read. A peer's finishes are added to this replica's own
  (``GatewayLoad.finished``), so the heartbeat correction
  (``gateway.routing.load``) takes every replica's finishes off.

Entries are batched into one ``XADD`` per flush (one stream entry each cost
a publisher ~40 µs more per flush and every reader 2.6x the CPU per entry:
with every process of every pod reading every other's, that grows with the
deployment), and the stream is trimmed to ``MAXLEN`` (approximate). A replica alone (it has listened for
``PEER_TTL_S`` and no other wrote) sends only its keepalive: route, settle and
changed-loads entries cost each request a share of an ``XADD`` that nobody
would read (7.6 % of a lone gateway's samples on small chats). A replica
announces itself with a loads entry as it starts, and answers a peer it has
not seen with one at once, so two replicas learn of each other within a round
trip; a request routed in that round trip is missed, as one routed before a
replica started always is. A stream rather than pub/sub: it is one
key (Redis Cluster serves it from one slot) and a reader that blipped resumes
where it was. Redis being down only loses the sharing: routing goes on from
the local view, and the loops retry.

The processes of one multi-process gateway (``--processes``) are replicas of
each other too, but their owner's index already saw every chain they routed
(on the index socket, ``gateway.routing.index_share``): their ids share the
gateway's ``pod`` prefix, the owner applies no chain from its own pod, and a
process leaves chains out while no live peer outside its pod keeps an index
(a 6k-token chat's chain was speculated twice at the owner: 4 % of its CPU).

What no stream can share is a burst: requests reaching every replica in the
same few milliseconds are routed before any entry about them arrives. So each
replica also knows its rank among the live ones (``rank``: gateway ids in
sorted order), and the router breaks its ties in that share of the fleet
(``gateway.routing.router``, step 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from redis.exceptions import RedisError

from gateway.routing.index import BlockIndex
from gateway.routing.load import GatewayLoad
from gateway.routing.mirror_state import raise_if_cancelled
from gateway.routing.prefix_demand import PrefixDemand
from gateway.routing.sessions import SessionMap

logger = logging.getLogger(__name__)

FLUSH_S = 0.002  # batch what a burst routes into one round trip (peers learn ~3 ms late)
KEEPALIVE_S = 1.0  # a replica's loads go out at least this often, changed or not
PEER_TTL_S = 3.0  # a peer's loads count this long after its last entry
MAXLEN = 20_000  # entries kept in the stream (approximately)
MAX_CHAIN = 2048  # blocks of a chain shared (32k tokens at block size 16)
# Entries per stream entry, and stream entries per read: a read holds at most ~1,000
# entries (up to 16 MB of chains), as when every entry was a stream entry of its own.
MAX_BATCH = 64
READ_COUNT = 16
_RETRY_S = 1.0


def _heard_lately(at: float, now: float) -> bool:
    """A peer last heard at ``at`` is still alive at ``now``."""
    return now - at <= PEER_TTL_S


@dataclass
class PeerLoad:
    """What one other replica has in flight on one worker."""

    inflight: int = 0
    pending: int = 0
    pending_prefill_tokens: int = 0


class ReplicaSync:
    """Publishes this replica's routing and applies the other replicas'."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        stream_key: str,
        index: BlockIndex | None,
        sessions: SessionMap,
        loads: dict[str, GatewayLoad],
        *,
        speculative_ttl_s: float,
        known_worker: Callable[[str], bool],
        prefix_demand: PrefixDemand | None = None,
        pod: str = "",
    ) -> None:
        self.client_factory = client_factory
        self.stream_key = stream_key
        self.index = index
        self.sessions = sessions
        self.loads = loads  # this replica's own counts (the Dispatcher's)
        self.speculative_ttl_s = speculative_ttl_s
        self.known_worker = known_worker
        self.prefix_demand = prefix_demand
        # "<pod>.<own>" for a process of a multi-process gateway, else a plain id.
        self.pod = pod
        self.gateway_id = f"{pod}.{uuid.uuid4().hex[:8]}" if pod else uuid.uuid4().hex[:12]
        self._outbox: list[dict[str, bytes | str]] = []
        self._finished_unsent: dict[str, int] = {}  # worker id -> own finishes not yet sent
        self._dirty = False  # a loads entry is due
        self._full_due = True  # ... and it is the whole view (a new peer, a lost entry)
        self._changed: set[str] = set()  # workers whose counts changed since the last one
        # Workers whose peer totals or peer-reported finishes changed since the
        # dispatcher's columns last read them (``gateway.routing.columns``).
        self.touched: set[str] = set()
        self._wake = asyncio.Event()
        # peer gateway id -> (monotonic time of its last loads entry, worker id -> load)
        self._peers: dict[str, tuple[float, dict[str, PeerLoad]]] = {}
        self._totals: dict[str, PeerLoad] = {}  # the live peers' views summed per worker
        self._rank = (0, 1)  # (this replica's rank, live replicas)
        self.applied = 0  # peer entries applied (tests, logs)
        self.tasks: list[asyncio.Task[None]] = []
        self._listening_since = math.inf  # until start(): never alone

    def start(self) -> list[asyncio.Task[None]]:
        """Starts the publishing and following loops (the app owns and cancels them)."""
        self._listening_since = time.monotonic()
        self._wake.set()  # announce this replica with its first loads entry now
        self.tasks = [
            asyncio.create_task(self.publish_forever(), name="kvroute-replicas-out"),
            asyncio.create_task(self.follow_forever(), name="kvroute-replicas-in"),
        ]
        return self.tasks

    # -- this replica's side ---------------------------------------------------------

    def routed(
        self,
        worker_id: str,
        chain: list[int],
        session_key: str | None,
        hold_s: float,
        wanted_prefix: int | None = None,
    ) -> None:
        """Tells the others that a request (its block chain, its session, the end of its
        longest cached prefix) went to ``worker_id``."""
        now = time.monotonic()
        if self.alone(now):
            return
        entry = self._chain_entry(worker_id, chain if self._chains_wanted(now) else [], hold_s)
        if session_key:
            entry["s"] = session_key
        if wanted_prefix is not None:
            entry["p"] = str(wanted_prefix)
        self._outbox.append(entry)
        self._changed.add(worker_id)
        self._dirty = True  # alone() was checked above: the loads go with this entry
        self._wake.set()

    def settled(self, worker_id: str, chain: list[int], ttl_s: float) -> None:
        """Tells the others how much longer ``chain`` counts as held (0: withdrawn)."""
        if chain and self._chains_wanted(time.monotonic()):
            self._outbox.append(self._chain_entry(worker_id, chain, ttl_s))
            self._wake.set()

    def _chain_entry(
        self, worker_id: str, chain: list[int], seconds: float
    ) -> dict[str, bytes | str]:
        entry: dict[str, bytes | str] = {"w": worker_id, "t": f"{seconds:g}"}
        if chain:
            entry["c"] = np.asarray(chain[:MAX_CHAIN], dtype="<u8").tobytes()
        return entry

    def load_changed(self, worker_id: str | None = None) -> None:
        """This replica's counts on ``worker_id`` changed (None: a peer needs them all):
        send them with the next flush."""
        if self.alone(time.monotonic()):
            return  # the keepalive still goes, for a replica that starts to find
        if worker_id is None:
            self._full_due = True
        else:
            self._changed.add(worker_id)
        self._dirty = True
        self._wake.set()

    def finished(self, worker_id: str) -> None:
        """A request this replica sent to ``worker_id`` ended: the others take it off the
        worker's heartbeat counts too (sent with the next loads entry)."""
        if self.alone(time.monotonic()):
            return
        self._finished_unsent[worker_id] = self._finished_unsent.get(worker_id, 0) + 1
        self._changed.add(worker_id)
        self._dirty = True
        self._wake.set()

    def alone(self, now: float) -> bool:
        """True when this replica has listened for ``PEER_TTL_S`` and no other wrote."""
        if now - self._listening_since < PEER_TTL_S:
            return False
        return not any(_heard_lately(at, now) for at, _ in self._peers.values())

    def _chains_wanted(self, now: float) -> bool:
        """Whether a peer may apply this replica's chains: one outside its pod is live,
        or it has not listened for ``PEER_TTL_S`` yet (not alone, then, either)."""
        if now - self._listening_since < PEER_TTL_S:
            return True
        return any(
            _heard_lately(at, now) and not self.same_pod(gid)
            for gid, (at, _) in self._peers.items()
        )

    def same_pod(self, gateway_id: str) -> bool:
        """Whether ``gateway_id`` is another process of this replica's gateway."""
        return bool(self.pod) and gateway_id.startswith(self.pod + ".")

    def _loads_entry(self, whole: bool) -> dict[str, bytes | str]:
        """The whole in-flight view (``l``), or the changes since the last entry (``d``)."""
        loads = self.loads
        if whole:
            view = {
                wid: [load.inflight, load.pending, load.pending_prefill_tokens]
                for wid, load in loads.items()
                if load.inflight or load.pending
            }
        else:
            none = GatewayLoad()
            view = {}
            for wid in self._changed:
                load = loads.get(wid, none)
                view[wid] = [load.inflight, load.pending, load.pending_prefill_tokens]
        self._changed = set()
        key = "l" if whole else "d"
        entry: dict[str, bytes | str] = {key: json.dumps(view, separators=(",", ":"))}
        if self._finished_unsent:
            # Deltas: an entry lost to a Redis error costs the others only the load
            # correction of those finishes until the worker's next heartbeat.
            entry["f"] = json.dumps(self._finished_unsent, separators=(",", ":"))
            self._finished_unsent = {}
        return entry

    async def publish_forever(self) -> None:
        """Flushes routed entries and load changes to the stream, batched."""
        client = self.client_factory()
        outage = _Outage("publish", "routing alone")
        last_whole = 0.0
        try:
            while True:
                raise_if_cancelled()  # redis-py may have swallowed the cancel
                try:
                    await asyncio.wait_for(self._wake.wait(), KEEPALIVE_S)
                    await asyncio.sleep(FLUSH_S)
                except TimeoutError:
                    pass
                self._wake.clear()
                batch, self._outbox = self._outbox, []
                now = time.monotonic()
                whole = self._full_due or now - last_whole >= KEEPALIVE_S
                if whole or self._dirty:
                    batch.append(self._loads_entry(whole))
                    self._dirty = False
                    if whole:
                        self._full_due, last_whole = False, now
                try:
                    for at in range(0, len(batch), MAX_BATCH):
                        packed = {
                            "g": self.gateway_id,
                            "b": msgpack.packb(batch[at : at + MAX_BATCH]),
                        }
                        await client.xadd(self.stream_key, packed, maxlen=MAXLEN, approximate=True)
                    outage.over()
                except (RedisError, OSError) as exc:
                    # Lost entries only cost sharing; the next (whole) loads entry repairs
                    # the counts.
                    outage.failed(exc)
                    self._full_due = self._dirty = True
                    await asyncio.sleep(_RETRY_S)
        finally:
            await _close(client)

    # -- the other replicas' side -----------------------------------------------------

    def peer_loads(self) -> Mapping[str, PeerLoad]:
        """The other replicas' live in-flight counts, per worker any of them has work on
        (read-only)."""
        return self._totals

    def rank(self) -> tuple[int, int]:
        """(this replica's rank, the number of live replicas): ids in sorted order.

        Every replica computes the same ranks from the same peers, so each can
        take its own share of the fleet's ties (``Router``'s step 4).
        """
        return self._rank

    def expire(self, now: float) -> None:
        """Drops the peers not heard for ``PEER_TTL_S`` (the follower calls it per read)."""
        stale = [g for g, (at, _) in self._peers.items() if not _heard_lately(at, now)]
        for gid in stale:
            for wid, p in self._peers.pop(gid)[1].items():
                self._count(wid, p, -1)
        if stale:
            self._ranked()

    def _ranked(self) -> None:
        live = sorted([self.gateway_id, *self._peers])
        self._rank = (live.index(self.gateway_id), len(live))

    def _count(self, worker_id: str, p: PeerLoad, sign: int) -> None:
        """Adds (``sign`` 1) or takes off (-1) one peer's counts on a worker to the totals."""
        self.touched.add(worker_id)
        t = self._totals.get(worker_id)
        if t is None:
            t = self._totals[worker_id] = PeerLoad()
        t.inflight += sign * p.inflight
        t.pending += sign * p.pending
        t.pending_prefill_tokens += sign * p.pending_prefill_tokens
        if not (t.inflight or t.pending or t.pending_prefill_tokens):
            del self._totals[worker_id]

    def _apply_loads(self, gid: str, raw: bytes, whole: bool, now: float) -> None:
        """A peer's whole view (``whole``) or its changes, into its view and the totals."""
        # Parsed whole before anything changes: a malformed entry leaves view and totals.
        parsed = {
            wid: PeerLoad(int(v[0]), int(v[1]), int(v[2])) for wid, v in json.loads(raw).items()
        }
        known = self._peers.get(gid)
        new_peer = known is None or not _heard_lately(known[0], now)
        view = {} if known is None else known[1]
        if whole or new_peer:
            for wid, p in view.items():
                self._count(wid, p, -1)
            view = {}
        for wid, p in parsed.items():
            old = view.pop(wid, None)
            if old is not None:
                self._count(wid, old, -1)
            if p.inflight or p.pending:
                view[wid] = p
                self._count(wid, p, 1)
        self._peers[gid] = (now, view)
        if new_peer:
            self._ranked()
            self.load_changed()  # a replica this one had not seen (lately): answer at once

    def apply(self, fields: dict[bytes, bytes], now: float) -> None:
        """Applies one stream entry written by any replica (its own are skipped)."""
        gid = fields.get(b"g", b"").decode()
        if not gid or gid == self.gateway_id:
            return
        self.applied += 1
        whole = fields.get(b"l")
        changes = whole if whole is not None else fields.get(b"d")
        if changes is not None:
            raw_finished = fields.get(b"f")
            if raw_finished is not None:
                for wid, n in json.loads(raw_finished).items():
                    if self.known_worker(wid):
                        self.loads.setdefault(wid, GatewayLoad()).finished += int(n)
                        self.touched.add(wid)
            self._apply_loads(gid, changes, whole is not None, now)
            return
        wid = fields.get(b"w", b"").decode()
        if not self.known_worker(wid):
            return
        chain = fields.get(b"c")
        # A front process of a gateway keeps no index, and its owner had the chains of
        # its own pod on the index socket already.
        if (
            chain
            and self.speculative_ttl_s > 0
            and self.index is not None
            and not self.same_pod(gid)
        ):
            hashes = np.frombuffer(chain, dtype="<u8").tolist()
            seconds = _seconds(fields.get(b"t"), self.speculative_ttl_s)
            if seconds > 0:
                self.index.speculate(wid, hashes, now, seconds)
            else:
                self.index.withdraw(wid, hashes)
        session = fields.get(b"s")
        if session:
            self.sessions.put(session.decode(), wid, now)
        wanted = fields.get(b"p")
        if wanted and self.prefix_demand is not None:
            with contextlib.suppress(ValueError):
                self.prefix_demand.observe(int(wanted), now)

    async def follow_forever(self) -> None:
        """Reads the stream from now on and applies the other replicas' entries."""
        client = self.client_factory()
        last = "$"
        outage = _Outage("read the peers' entries", "routing from the local view")
        try:
            while True:
                raise_if_cancelled()  # redis-py may have swallowed the cancel
                try:
                    reply = await client.xread(
                        {self.stream_key: last}, count=READ_COUNT, block=int(KEEPALIVE_S * 1000)
                    )
                    outage.over()
                except (RedisError, OSError) as exc:
                    outage.failed(exc)
                    await asyncio.sleep(_RETRY_S)
                    self.expire(time.monotonic())  # unheard peers age out meanwhile too
                    continue
                now = time.monotonic()
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        try:
                            for entry in unbatched(fields):
                                self.apply(entry, now)
                        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                            logger.warning("replica sync: skipped a malformed entry (%s)", exc)
                # Peers' views age out even when nothing arrives.
                self.expire(now)
        finally:
            await _close(client)


def unbatched(fields: dict[bytes, bytes]) -> Iterator[dict[bytes, bytes]]:
    """The entries of one stream entry, each with its replica's ``g``: a flush's batch
    (``b``), or the entry itself as older replicas wrote it. ``ValueError`` when the
    batch is not a msgpack list of maps."""
    raw = fields.get(b"b")
    if raw is None:
        yield fields
        return
    batch = msgpack.unpackb(raw, raw=True)
    if not isinstance(batch, list):
        raise ValueError("a batch that is not a list")
    gid = fields.get(b"g", b"")
    for entry in batch:
        if not isinstance(entry, dict):
            raise ValueError("a batched entry that is not a map")
        entry[b"g"] = gid
        yield entry


class _Outage:
    """Logs the start and the end of a run of Redis failures once each, not per retry."""

    def __init__(self, what: str, meanwhile: str) -> None:
        self.what, self.meanwhile = what, meanwhile
        self.failing = False

    def failed(self, exc: Exception) -> None:
        if not self.failing:
            logger.warning("replica sync: cannot %s (%s); %s", self.what, exc, self.meanwhile)
        self.failing = True

    def over(self) -> None:
        if self.failing:
            logger.info("replica sync: can %s again", self.what)
        self.failing = False


def _seconds(raw: bytes | None, default: float) -> float:
    """An entry's hold in seconds (older replicas send none: ``default``)."""
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if math.isfinite(value) else default


async def _close(client: Any) -> None:
    close = getattr(client, "aclose", None) or client.close
    with contextlib.suppress(RedisError, OSError):
        await close()
