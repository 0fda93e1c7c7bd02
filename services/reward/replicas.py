"""`Replicas`: the reward servers a `RewardClient` target names, one gRPC channel each, and each one's liveness.

A headless Kubernetes Service's name resolves to every reward pod. Left to gRPC (one channel, round_robin over the
name), the client could not tell which pod a call waited on, so its progress clock (a call times out only once the
server answered none of the client's calls for `timeout_s`) was one for all of them: a stuck pod beside a healthy
one was not timed out while the healthy one answered, and a pod added to the Service was used only once gRPC
resolved the name again (after a connection ended). So the client picks the address of each call itself:

- Targets. A name (`host:port` whose host is no IP literal, `dns:///host:port`) is resolved with `getaddrinfo`
  (or the client's `resolver`: target -> ["ip:port", ...]) and again every `resolve_every_s` (5 s), and at once
  (at most twice a second) after a call found an address unreachable or the name had none: an address added is
  called within that period; one removed gets no new calls and its channel is closed once its calls end. A
  resolution that fails (DNS down, or no pod ready: the name unknown; or any error of the resolver's) keeps the
  addresses known, as gRPC does, and is logged once (`reward_resolve_failed`) until it succeeds or fails otherwise.
  Each address's channel sends the name (`host:port`) as its `:authority`, as one channel on the name did. The
  resolving thread holds the client weakly: a client dropped without `close()` is collected, channels and thread.
  `ipv4:a,b` / `ipv6:...` lists are one channel per distinct address, never re-resolved. Any other target (an IP
  `host:port`, `[ip6]:port`, any other scheme: `unix:`, `xds:`, a plugin's, ...) is one channel on the target as
  given, resolved by gRPC, exactly as a single-address client was.
- Liveness per address. Each replica has its own progress clock (`last_answer`): a call on it times out once it
  answered none of the client's calls for `timeout_s` since the call began, whatever the others answer. A replica
  that timed out a call gets no new calls for `timeout_s` while another is usable, then one (a probe) per
  `timeout_s` until it answers again.
- Picking. Round robin over the best-ranked replicas: answering before timed out, reachable (not in
  TRANSIENT_FAILURE: `localhost` resolves to ::1 as well, where a server bound to 127.0.0.1 refuses) before not,
  READY before connecting or not known yet; a retry prefers another replica than the one its attempt failed on.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from tlt.services.common.logging import get_logger
from tlt.v1 import reward_pb2_grpc

Resolver = Callable[[str], list[str]]
log = get_logger("reward.client")
_DIRECT_SCHEMES = ("ipv4:", "ipv6:")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)  # a URI's scheme, as gRPC parses a target
_MIN_RESOLVE_GAP_S = 0.5  # re-resolving asked for on a failure: at most this often
# gRPC's connectivity polling thread (`Channel.subscribe`'s) looks every 0.2 s whether anyone is still subscribed and
# raises "Channel closed!" in its thread if the channel closed between that look and its next one (grpc issue 18995):
# a watched channel is closed once that thread has ended. A fixed 0.3 s was not always enough on a loaded host (the
# traceback printed in CI). The thread's end is read from grpc's private `_connectivity_state.polling`; where a grpcio
# lacks it, the channel closes after UNWATCHED_S; in any case by UNWATCHED_MAX_S (a client's `close()`, which waits
# for it, by UNWATCHED_CLOSE_S).
UNWATCHED_S = 0.3
UNWATCHED_MAX_S = 10.0
UNWATCHED_CLOSE_S = 2.0


def _ignore(_: grpc.ChannelConnectivity) -> None:
    """A connectivity callback for a subscription made only to ask gRPC to connect."""


class NoAddress(Exception):
    """The target's name resolves to no address (yet): a call fails as UNAVAILABLE and is retried."""


class Replica:
    """One address of the target: its channel and stub, calls in flight, and when it last answered."""

    def __init__(self, address: str, options: list, watch: bool) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)
        self.last_answer = 0.0  # monotonic time this address last answered one of the client's calls
        self.avoid_until = 0.0  # a call on it timed out: no new call until then (0: answering)
        self.in_flight = 0
        self.removed = False
        self._state: grpc.ChannelConnectivity | None = None
        self._closed = False
        self._watching = watch
        if watch:  # connect at once: by the first call, an address refusing connections is known as such
            # gRPC's polling thread holds the callback: it holds the replica weakly, so that a client dropped without
            # close() is collected, and its channel unsubscribed and closed then (as an unwatched channel is)
            self._changed = _changed_callback(weakref.ref(self))
            self._dropped = weakref.finalize(self, _close_soon, self.channel, self._changed)
            self._dropped.atexit = False
            self.channel.subscribe(self._changed, try_to_connect=True)

    def state(self) -> grpc.ChannelConnectivity | None:
        """The channel's latest connectivity (`Channel.subscribe`'s, public on every grpcio), and a connection
        attempt if it is idle (a server that closed the connection: restarted); None when not watched or not known
        yet."""
        if not self._watching:
            return None
        state = self._state
        if state is grpc.ChannelConnectivity.IDLE and not self._closed:
            self.channel.subscribe(_ignore, try_to_connect=True)  # a subscription asking to connect: gRPC's one way
            self.channel.unsubscribe(_ignore)
        return state

    def answered(self) -> None:
        self.last_answer = time.monotonic()
        self.avoid_until = 0.0

    def timed_out(self, timeout_s: float) -> None:
        self.avoid_until = time.monotonic() + timeout_s

    def unwatch(self) -> bool:
        """Stop following the connectivity (before `close`); whether it was followed."""
        self._closed = True
        if self._watching and self._dropped.detach() is not None:
            self.channel.unsubscribe(self._changed)
        return self._watching

    def close(self) -> None:
        """Close the channel now, cutting off its calls (a watched one: `unwatch` it `UNWATCHED_S` before)."""
        self.unwatch()
        self.channel.close()

    def close_soon(self) -> None:
        """`close` once gRPC's polling thread saw the end of the subscription (a channel with no calls in flight)."""
        if self.unwatch():
            _close_soon(self.channel, None)
        else:
            self.channel.close()


def _changed_callback(ref: weakref.ReferenceType) -> Callable[[grpc.ChannelConnectivity], None]:
    """gRPC's connectivity callback (its own thread) of the replica `ref` holds: keeps the channel's latest state."""
    def changed(state: grpc.ChannelConnectivity) -> None:
        replica = ref()
        if replica is not None:
            replica._state = state
    return changed


def _close_soon(channel: grpc.Channel, callback: Callable[[grpc.ChannelConnectivity], None] | None) -> None:
    """Unsubscribe `callback` (None: done) and close `channel` once gRPC's polling thread has ended (see
    UNWATCHED_S), from a short-lived thread of its own."""
    if callback is not None:
        channel.unsubscribe(callback)
    threading.Thread(target=_close_when_unwatched, args=(channel,), name="reward-channel-close", daemon=True).start()


def _close_when_unwatched(channel: grpc.Channel) -> None:
    _wait_unwatched([channel], UNWATCHED_MAX_S)
    channel.close()


def _wait_unwatched(channels: list[grpc.Channel], most_s: float) -> None:
    """Wait UNWATCHED_S, then until gRPC's polling thread of each of `channels` has ended, `most_s` in all."""
    deadline = time.monotonic() + most_s
    time.sleep(UNWATCHED_S)
    for channel in channels:
        state = getattr(channel, "_connectivity_state", None)
        while getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.05)


class Replicas:
    """Every address of a target, re-resolved as the module docstring says. Thread-safe."""

    def __init__(self, target: str, options: list, timeout_s: float, resolver: Resolver | None = None,
                 resolve_every_s: float = 5.0) -> None:
        if resolve_every_s <= 0:
            raise ValueError(f"resolve_every_s must be > 0, got {resolve_every_s}")
        self.target = target
        self._options = options
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}  # in the resolver's order; removed ones stay until their calls end
        self._next = 0
        self._problem = ""  # why the last resolution failed or gave no address
        self._logged = ""  # the resolution error last logged (each distinct one is logged once)
        self._closing = threading.Event()
        self._wake = threading.Event()
        self._resolver = resolver if resolver is not None else (resolve if _is_name(target) else None)
        if self._resolver is None:
            fixed = _direct_addresses(target)
            for address in fixed:
                self._replicas[address] = Replica(address, options, watch=len(fixed) > 1)
            return
        try:  # each address's channel names the name, as one channel on it did (a proxy or mesh routes by host)
            host, port = _host_port(target)
        except ValueError:
            pass
        else:
            if not any(key == "grpc.default_authority" for key, _ in options):
                self._options = [*options, ("grpc.default_authority", f"{host}:{port}")]
        self._refresh_logged()
        # the thread holds this object weakly, so that a client dropped without close() is collected (channels
        # and all, as a single-channel client was); collected, it wakes the thread to end
        weakref.finalize(self, _stop, self._closing, self._wake)
        threading.Thread(target=_loop, args=(weakref.ref(self), self._closing, self._wake, resolve_every_s),
                         name="reward-client-resolve", daemon=True).start()

    # ---- resolution ----------------------------------------------------------------------

    def _refresh(self) -> None:
        assert self._resolver is not None
        try:
            found = list(dict.fromkeys(self._resolver(self.target)))
        except (OSError, UnicodeError) as e:  # socket.gaierror: the name is unknown (no pod ready), DNS down
            with self._lock:  # the addresses known stay (as gRPC keeps its last resolution): DNS may be down a moment
                self._problem = f"{type(e).__name__}: {e}"
            return
        closing: list[Replica] = []
        unusable: list[str] = []
        with self._lock:
            if self._closing.is_set():
                return
            for address in found:
                replica = self._replicas.get(address)
                if replica is None:
                    try:
                        self._replicas[address] = Replica(address, self._options, watch=True)
                    except Exception as e:  # noqa: BLE001 - one address gRPC cannot make a channel of: the others
                        unusable.append(f"{address}: {type(e).__name__}: {e}")
                        continue
                    log.info("reward_address_added", target=self.target, address=address)
                elif replica.removed:  # back before its calls ended: keep its connection
                    replica.removed = False
            for address, replica in list(self._replicas.items()):
                if address not in found and not replica.removed:
                    replica.removed = True
                    log.info("reward_address_removed", target=self.target, address=address,
                             calls_in_flight=replica.in_flight)
                if replica.removed and replica.in_flight == 0:
                    closing.append(self._replicas.pop(address))
            self._problem = "; ".join(unusable)
        for replica in closing:
            replica.close_soon()

    def _refresh_logged(self) -> None:
        """`_refresh`, any error of it (a resolver's bug, a channel that cannot be made) kept as the problem and
        logged once: the addresses known stay and resolution goes on."""
        try:
            self._refresh()
        except Exception as e:  # noqa: BLE001 - whatever the resolver raises, the resolving must go on
            problem = f"{type(e).__name__}: {e}"
            with self._lock:
                self._problem = problem
        with self._lock:
            problem, new = self._problem, self._problem != self._logged
            self._logged = problem
        if problem and new:
            log.warning("reward_resolve_failed", target=self.target, error=problem,
                        addresses_kept=self.count())

    def resolve_soon(self) -> None:
        """Resolve the name again now (a call found an address unreachable: a pod gone, maybe a new one)."""
        self._wake.set()

    # ---- picking -------------------------------------------------------------------------

    def _rank(self, replica: Replica, now: float, failed: Replica | None) -> tuple[bool, bool, bool, bool]:
        # None (not watched: every replica alike; or its first report not in yet) ranks as not READY: ranked as
        # READY, an unknown address that had just refused a call won the retry over a live one still CONNECTING
        state = replica.state()
        return (now < replica.avoid_until, state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                                                     grpc.ChannelConnectivity.SHUTDOWN),
                state is not grpc.ChannelConnectivity.READY, replica is failed)

    @contextmanager
    def use(self, failed: Replica | None = None) -> Iterator[Replica]:
        """A replica for one attempt (not `failed`, the one the last attempt failed on, if another is as good),
        counted in flight until the block ends; `NoAddress` when the name resolves to none."""
        replica = self._pick(failed)
        try:
            yield replica
        finally:
            self._release(replica)

    def _pick(self, failed: Replica | None) -> Replica:
        now = time.monotonic()
        with self._lock:
            live = [r for r in self._replicas.values() if not r.removed]
            if not live:
                if self._resolver is not None:
                    self._wake.set()
                why = f" ({self._problem})" if self._problem else ""
                raise NoAddress(f"{self.target} resolves to no address{why}")
            ranks = [self._rank(r, now, failed) for r in live]
            best = min(ranks)
            choices = [r for r, rank in zip(live, ranks) if rank == best]
            self._next += 1
            replica = choices[self._next % len(choices)]
            if replica.avoid_until:  # a probe of a replica that timed out: the next one after another timeout_s
                replica.avoid_until = now + self._timeout_s
            replica.in_flight += 1
            return replica

    def _release(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1
            done = replica.removed and replica.in_flight == 0 and self._replicas.get(replica.address) is replica
            if done:
                del self._replicas[replica.address]
        if done:
            replica.close_soon()

    # ---- the rest ------------------------------------------------------------------------

    def count(self) -> int:
        """How many addresses calls may go to."""
        with self._lock:
            return sum(not r.removed for r in self._replicas.values())

    def channels(self) -> list[grpc.Channel]:
        with self._lock:
            return [r.channel for r in self._replicas.values() if not r.removed]

    def addresses(self, including_draining: bool = False) -> list[str]:
        with self._lock:
            return [a for a, r in self._replicas.items() if including_draining or not r.removed]

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether a channel of the target (any address of a name, resolved again meanwhile) connects within
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        ready = threading.Event()
        waiting: dict[grpc.Channel, grpc.Future] = {}
        try:
            while True:
                for channel in self.channels():
                    if channel not in waiting:
                        waiting[channel] = grpc.channel_ready_future(channel)
                        waiting[channel].add_done_callback(lambda f: f.cancelled() or ready.set())
                left = deadline - time.monotonic()
                if ready.wait(max(0.0, min(left, 0.1))):
                    return True
                if left <= 0 or self._closing.is_set():  # closing: its futures' subscriptions end now, so the
                    return False  # close waits for gRPC's polling threads no longer than it must (UNWATCHED_S)
                if not waiting and self._resolver is not None:
                    self._wake.set()
        finally:
            for future in waiting.values():
                future.cancel()

    def why_none(self) -> str:
        """Why no address could be called, for an error message: the name has none, or ''."""
        with self._lock:
            if any(not r.removed for r in self._replicas.values()):
                return ""
            return f" ({self.target} resolves to no address{': ' + self._problem if self._problem else ''})"

    def named(self, replica: Replica | None) -> str:
        """The target, and the replica's address when that is another (a name's pod): for error messages."""
        if replica is None or replica.address == self.target:
            return self.target
        return f"{self.target} ({replica.address})"

    def close(self) -> None:
        """Close every channel (cutting off the calls in flight) and stop re-resolving."""
        with self._lock:
            self._closing.set()
            self._wake.set()
            replicas, self._replicas = list(self._replicas.values()), {}
        watched = [replica.channel for replica in replicas if replica.unwatch()]
        if watched:  # calls in flight run on meanwhile, cut off at the close
            _wait_unwatched(watched, UNWATCHED_CLOSE_S)
        for replica in replicas:
            replica.close()


def _stop(closing: threading.Event, wake: threading.Event) -> None:
    closing.set()
    wake.set()


def _loop(ref: weakref.ReferenceType, closing: threading.Event, wake: threading.Event, every_s: float) -> None:
    """The resolving thread: `ref`'s name again every `every_s`, or soon when woken; ends once it is closed or
    collected (holding it only while it resolves)."""
    last = time.monotonic()
    while not closing.is_set():
        if wake.wait(max(0.0, last + every_s - time.monotonic())):  # asked for: not too often
            if closing.wait(max(0.0, last + _MIN_RESOLVE_GAP_S - time.monotonic())):
                return
        wake.clear()
        replicas = ref()
        if replicas is None or closing.is_set():
            return
        last = time.monotonic()
        replicas._refresh_logged()
        del replicas


def resolve(target: str) -> list[str]:
    """The default resolver: every address of a `host:port` / `dns:///host:port` target's name (TCP), as
    `ip:port` / `[ip6]:port`, in getaddrinfo's order."""
    host, port = _host_port(target)
    out: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = sockaddr[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return out


def _host_port(target: str) -> tuple[str, int]:
    if target.startswith("dns:"):
        target = target[len("dns:"):]
        if target.startswith("//"):  # dns://authority/host:port: the authority (a DNS server) is not used
            target = target[2:].split("/", 1)[-1]
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _is_name(target: str) -> bool:
    """Whether the target is a DNS name the client resolves itself: `host:port` with a host that is no IP literal, or
    `dns:`. Any other `scheme:` (unix:, passthrough:, xds:, ...) is gRPC's to resolve; `host:port` parses as one, so
    a scheme followed by a port alone is a host."""
    scheme = _SCHEME.match(target)
    if scheme and scheme.group(1) != "dns" and not scheme.group(2).isdigit():
        return False
    try:
        host, _ = _host_port(target)
    except ValueError:
        return False  # not host:port: gRPC's to judge, as before
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(host)
    return False


def _direct_addresses(target: str) -> list[str]:
    """A target not resolved here: an `ipv4:` / `ipv6:` list as one target per address, anything else as itself."""
    scheme = next((s for s in _DIRECT_SCHEMES if target.startswith(s)), None)
    if scheme is None:
        return [target]
    parts = list(dict.fromkeys(p for p in target[len(scheme):].split(",") if p))  # one replica an address
    return [f"{scheme}{p}" for p in parts] if len(parts) > 1 else [target]
