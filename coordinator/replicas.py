"""The replicas of one model service: discovery, health, and which sequences live where.

A sequence's KV cache lives on one target replica and one draft replica, so the coordinator
keeps each sequence on the replicas it was placed on for its life (affinity) and places new
sequences on the healthy replica holding the fewest. A replica that fails is marked down and
probed again with exponential backoff (tenacity); its sequences are detached, and the scheduler
places them elsewhere and re-prefills them from the coordinator's history: a failure costs
time, never a request.

Endpoints come from a static list (``host:port,host:port``) or from DNS (``dns:name:port``,
e.g. a Kubernetes headless Service, one address per ready pod), re-resolved periodically.

A healthy replica that no call reaches (a draft while the k policy runs k = 0, any replica while
no request runs) would never be found down by a failed call, so a watcher health-checks it every
WATCH_SECONDS. The same watcher asks a crowded replica (one that refused a new sequence for want
of room: another coordinator's sequences, say, left behind until their lease runs out) for its
CacheStats until it holds less than it did, so that new sequences go there again.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import Retrying, retry_if_exception_type, wait_exponential

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
JOINING_PROBE_SECONDS = 0.5  # the longest wait between probes of a replica that has not served yet
# How often the watcher health-checks a healthy replica no call has answered since, and asks a
# crowded one for its room: Info and placement are that much behind a replica that dies unused.
WATCH_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 2.0  # of one health check


class NotReady(Exception):
    """A probe found the replica not serving (yet), or not fit to join."""


def resolve(spec: str) -> list[str]:
    """``host:port[,host:port…]`` as given, or ``dns:name:port`` (also ``dns:///name:port``)
    resolved to one ``ip:port`` per address record, sorted. Raises OSError when DNS fails."""
    spec = spec.strip()
    if not spec.startswith(DNS_PREFIX):
        return [a.strip() for a in spec.split(",") if a.strip()]
    name = spec[len(DNS_PREFIX):].lstrip("/")
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{spec!r}: expected dns:NAME:PORT")
    found = {info[4][0] for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)}
    return sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in found)


@dataclass(eq=False)
class Replica:
    service: str  # "target" or "draft"
    address: str
    client: object  # backends.ServiceClient
    healthy: bool = False
    removed: bool = False  # gone from discovery: never used again
    failures: int = 0
    assigned: set[str] = field(default_factory=set)  # seq ids whose cache lives here
    # Sequences detached while it was down: if it comes back without having restarted it still
    # holds them, so they are released once it answers again.
    orphans: set[str] = field(default_factory=set)
    prober: threading.Thread | None = None
    # (sequences, cached tokens) the service held when it last had no room for a new sequence,
    # where releasing what it holds can make room; None: not known to be full. While set, no new
    # sequence is placed here; our own release here, or the service holding less, lifts it.
    crowded: tuple[int, int] | None = None


class ReplicaSet:
    """Every known replica of one service. The scheduler thread assigns and detaches; prober
    and discovery threads change health and membership under ``lock``."""

    def __init__(self, service: str, spec: str, make_client, check=None, *, health_service: str = "",
                 refresh_seconds: float = 10.0, backoff_seconds: float = 0.1, max_backoff_seconds: float = 5.0,
                 on_health=None):
        """``make_client(address)`` opens a client; ``check(client)`` raises NotReady when a
        replica may not join (another model, say), and may return its CacheStats;
        ``on_health(replica)`` is told of changes."""
        self.service, self.spec, self.make_client = service, spec, make_client
        self.check = check or (lambda client: None)
        self.health_service = health_service
        self.refresh_seconds = refresh_seconds
        self.backoff = wait_exponential(multiplier=backoff_seconds, max=max_backoff_seconds)
        # A replica that has not served yet is most likely starting (loading its model, seconds):
        # probed at most JOINING_PROBE_SECONDS apart, it joins within that of serving, where the
        # down-replica backoff could leave it waiting up to max_backoff_seconds.
        self.joining_backoff = wait_exponential(multiplier=backoff_seconds,
                                                max=min(max_backoff_seconds, JOINING_PROBE_SECONDS))
        self.on_health = on_health or (lambda replica: None)
        self.replicas: dict[str, Replica] = {}
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.discovery: threading.Thread | None = None
        self.watcher: threading.Thread | None = None

    @classmethod
    def of(cls, service: str, client) -> "ReplicaSet":
        """One replica over a client already open, taken as healthy (the profiler's own use)."""
        replicas = cls(service, client.address, lambda address: client)
        replicas.replicas[client.address] = Replica(service, client.address, client, healthy=True)
        return replicas

    # ---- membership -------------------------------------------------------------------------------

    def start(self) -> "ReplicaSet":
        """Resolve and probe every endpoint once now, then keep re-resolving DNS endpoints."""
        self.refresh()
        if self.spec.strip().startswith(DNS_PREFIX):
            self.discovery = threading.Thread(target=self._discover, name=f"discover-{self.service}", daemon=True)
            self.discovery.start()
        self.watcher = threading.Thread(target=self._watch, name=f"watch-{self.service}", daemon=True)
        self.watcher.start()
        return self

    def refresh(self) -> None:
        try:
            addresses = resolve(self.spec)
        except OSError as error:  # keep what we have: a DNS hiccup is not every pod leaving
            log.warning("cannot resolve %s endpoints %s: %s", self.service, self.spec, error,
                        extra={"service": self.service})
            return
        with self.lock:
            known = set(self.replicas)
            for address in addresses:
                if address not in known:
                    self.replicas[address] = Replica(self.service, address, self.make_client(address))
            gone = [self.replicas.pop(a) for a in known - set(addresses)]
        for replica in gone:
            log.info("%s replica %s left discovery", self.service, replica.address,
                     extra={"service": self.service, "replica": replica.address})
            replica.removed, replica.healthy = True, False
            self.on_health(replica)
        for address in addresses:
            replica = self.replicas.get(address)
            if replica is not None and not replica.healthy and replica.prober is None:
                self._start_prober(replica)  # a new one: it joins once a probe finds it serving

    def _discover(self) -> None:
        while not self.closed.wait(self.refresh_seconds):
            self.refresh()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            replicas = list(self.replicas.values())
        for replica in replicas:
            replica.client.close()

    # ---- health -------------------------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str, cooldown: float = 0.0) -> None:
        """Stop using a replica and probe it with backoff until it serves again. ``cooldown``: the
        least time to stay down (a replica too slow for its deadline is probably still serving)."""
        with self.lock:
            if not replica.healthy:
                return
            replica.healthy = False
            replica.failures += 1
        log.warning("%s replica %s is down (%s); probing it with backoff", self.service, replica.address, reason,
                    extra={"service": self.service, "replica": replica.address})
        self.on_health(replica)
        self._start_prober(replica, cooldown)

    def _start_prober(self, replica: Replica, cooldown: float = 0.0) -> None:
        replica.prober = threading.Thread(target=self._probe_until_healthy, args=(replica, cooldown),
                                          name=f"probe-{self.service}-{replica.address}", daemon=True)
        replica.prober.start()

    def _probe_until_healthy(self, replica: Replica, cooldown: float) -> None:
        if self.closed.wait(cooldown):
            return
        # Anything a probe raises means "not yet" (its channel may even be closed under it when
        # the coordinator stops); only closing or leaving discovery ends the probing.
        joining = replica.failures == 0  # never marked down: it has not served yet
        retrying = Retrying(retry=retry_if_exception_type(Exception),
                            wait=self.joining_backoff if joining else self.backoff,
                            stop=lambda state: self.closed.is_set() or replica.removed, sleep=self.closed.wait)
        try:
            for attempt in retrying:
                with attempt:
                    self.probe(replica)
        except Exception:  # noqa: BLE001 - RetryError: closed or removed while probing
            return
        finally:
            replica.prober = None
        with self.lock:
            replica.healthy = not replica.removed
        if replica.healthy:
            log.info("%s replica %s is serving", self.service, replica.address,
                     extra={"service": self.service, "replica": replica.address})
            self.on_health(replica)

    def probe(self, replica: Replica) -> None:
        """Serving, fit to join, and holding none of our abandoned sequences; or raise."""
        self.check_health(replica)
        stats = self.check(replica.client)
        if stats is not None and stats.sequences >= stats.max_sequences:  # full of others' sequences
            self.crowd(replica, stats, ours=0)
        elif stats is not None:
            self.has_room(replica, f"it holds {stats.sequences} of {stats.max_sequences} sequences")
        if replica.orphans:
            orphans = list(replica.orphans)
            replica.client.release(orphans)
            replica.orphans.difference_update(orphans)

    def check_health(self, replica: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.client.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=self.health_service), timeout=PROBE_TIMEOUT_SECONDS)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise NotReady(f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")

    def _watch(self) -> None:
        while not self.closed.wait(WATCH_SECONDS):
            for replica in self.healthy():
                try:
                    self.watch(replica)
                except Exception:  # noqa: BLE001 - the watcher must outlive anything one replica does
                    log.exception("watching %s replica %s failed", self.service, replica.address)

    def watch(self, replica: Replica) -> None:
        """One look at a healthy replica: down if it was unused and fails a health check; room
        again if it was crowded and now holds less."""
        answered = replica.client.answered
        if time.monotonic() - answered > WATCH_SECONDS:
            try:
                self.check_health(replica)
            except Exception as error:  # noqa: BLE001 - any failure: not serving
                # Unless a call got through meanwhile, or the channel was closed under it (stopping).
                if replica.client.answered == answered and not self.closed.is_set():
                    self.mark_down(replica, f"unused, and its health check failed: {error}")
                return
        crowded = replica.crowded
        if crowded is not None:
            try:
                stats = replica.client.cache_stats(timeout=PROBE_TIMEOUT_SECONDS)
            except Exception:  # noqa: BLE001 - crowded still; a failing replica is found by its calls
                return
            if stats.sequences < crowded[0] or stats.cached_tokens < crowded[1]:
                self.has_room(replica, f"it holds {stats.sequences} of {stats.max_sequences} sequences now")

    def crowd(self, replica: Replica, stats, ours: int) -> None:
        """The service (its CacheStats ``stats``, None where they could not be had) has no room
        for a new sequence, though it may have once what it holds is released (``ours`` of them
        are ours): no new sequence goes there until then."""
        if replica.crowded is None:
            held = "unknown" if stats is None else f"{stats.sequences} of {stats.max_sequences} cached, {ours} ours"
            log.warning("%s replica %s has no room for a new sequence (%s): new requests wait for room there",
                        self.service, replica.address, held, extra={"service": self.service, "replica": replica.address})
        # Unknown: the watcher's next look at it, whatever it finds, lifts it.
        replica.crowded = (sys.maxsize, sys.maxsize) if stats is None else (stats.sequences, stats.cached_tokens)

    def has_room(self, replica: Replica, why: str) -> None:
        if replica.crowded is not None:
            replica.crowded = None
            log.info("%s replica %s takes new sequences again: %s", self.service, replica.address, why,
                     extra={"service": self.service, "replica": replica.address})

    def wait_healthy(self, timeout: float) -> Replica:
        """The first healthy replica, waiting up to ``timeout`` seconds for one."""
        deadline = time.monotonic() + timeout
        while True:
            healthy = self.healthy()
            if healthy:
                return healthy[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {self.service} replica of {self.spec!r} is serving after {timeout:.0f}s")
            time.sleep(0.05)

    # ---- placement (scheduler thread) ---------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        with self.lock:
            return [r for r in self.replicas.values() if r.healthy]

    def open(self) -> list[Replica]:
        """The healthy replicas that may take a new sequence (not crowded)."""
        return [r for r in self.healthy() if r.crowded is None]

    def pick(self, prefer: str | None = None) -> Replica | None:
        """The open replica holding the fewest sequences: new sequences balance the load. With
        ``prefer``: the open one at that address, where there is one (a draft hosted in the
        target's process, to draft inside its Verify)."""
        open_ = self.open()
        chosen = next((r for r in open_ if r.address == prefer), None) if prefer else None
        return chosen or min(open_, key=lambda r: (len(r.assigned), r.address), default=None)

    def attach(self, replica: Replica, seq_id: str) -> None:
        replica.assigned.add(seq_id)

    def detach(self, replica: Replica, seq_id: str) -> None:
        """The sequence no longer lives here: finished (released by the caller) or moved away
        because the replica is down (its copy is released once the replica answers again)."""
        replica.assigned.discard(seq_id)
        if not replica.healthy and not replica.removed:
            replica.orphans.add(seq_id)

    def all(self) -> list[Replica]:
        with self.lock:
            return list(self.replicas.values())
