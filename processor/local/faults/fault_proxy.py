"""A fault-injecting HTTP reverse proxy for S3, DynamoDB and Kinesis emulators.

Exactly-once claims are only as good as the failures they were tested against. This proxy sits
between real boto3 clients and an emulator (moto server, kinesalite) and makes chosen requests
fail the way AWS fails: throttling and 5xx answers with the service's own error bodies, dropped
connections, slow answers, the nasty case where the upstream *applied* a request but the
client is told it failed (``after=True``), which a retried conditional write then trips over,
and Kinesis PutRecords calls that fail some of their entries (`set_partial`).

    with FaultProxy(aws.s3_endpoint, seed=7) as proxy:
        proxy.add(Rule("s3", "PutObject", status=503, times=2))
        s3 = boto3.client("s3", endpoint_url=proxy.url)
        s3.put_object(Bucket="b", Key="k", Body=b"x")  # two SlowDowns, retried, then stored
        assert proxy.counts()[("s3", "PutObject")] == 3

Rules (`rules.py`) are tried in the order they were added and at most one fires per request.
This module is the proxy's face: its rules, partial failures, counters, start and stop. How
a request is read, forwarded and answered is `forwarding.py`; error answers are
`aws_answers.py`; partial PutRecords failures `partial_failures.py`. Clients must address
S3 path-style, which boto3 does for an IP endpoint such as ``proxy.url``.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from urllib.parse import urlsplit

from shardless.processor.local.faults.forwarding import HOST, Server
from shardless.processor.local.faults.partial_failures import PartialFailure
from shardless.processor.local.faults.rules import ActiveRule, Call, Rule


class FaultProxy:
    """Reverse proxy to `upstream` on 127.0.0.1 that breaks requests according to its rules.

    Thread-safe: rules may be added or cleared, and partial failures set, while clients run.
    Counters are keyed by (service, op): `counts` is every request received, `forwarded`
    those sent upstream and `injected` those a rule fired on (delays included); `fired(rule)`
    counts one rule (several rules may target the same operation). Partial PutRecords
    failures are counted in `entries_failed` (entries reported failed), `entries_dropped`
    (of those, entries not forwarded to the emulator) and `calls_altered`.
    """

    def __init__(
        self,
        upstream: str,
        rules: Iterable[Rule] = (),
        seed: int = 0,
        partial: PartialFailure | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream {upstream!r}: expected http://host:port")
        self.upstream = upstream
        self._seed = seed
        self._lock = threading.Lock()
        self._rules: list[ActiveRule] = []
        self._added = 0  # rules ever added: a rule's RNG stream depends on its position only
        self._counts: Counter[tuple[str, str]] = Counter()
        self._forwarded: Counter[tuple[str, str]] = Counter()
        self._injected: Counter[tuple[str, str]] = Counter()
        self._fired: Counter[Rule] = Counter()
        self._partial: PartialFailure | None = None
        self._partial_left: int | None = None
        self._partial_rng = random.Random(f"{seed}/partial")
        self._partial_lock = threading.Lock()
        self.entries_failed = 0  # entries reported failed so far
        self.entries_dropped = 0  # of those, entries not forwarded to the emulator
        self.calls_altered = 0
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        for rule in rules:
            self.add(rule)
        self.set_partial(partial)

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            rng = random.Random(f"{self._seed}/{self._added}")
            self._added += 1
            self._rules.append(ActiveRule(rule, rng))
        return rule

    def clear(self) -> None:
        """Remove every rule; counters are kept (see `reset_counts`)."""
        with self._lock:
            self._rules.clear()

    def set_partial(self, partial: PartialFailure | None) -> None:
        """Fail entries of PutRecords calls from now on (None: no longer)."""
        with self._partial_lock:
            self._partial = partial
            self._partial_left = None if partial is None else partial.times

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
            self._forwarded.clear()
            self._injected.clear()
            self._fired.clear()
        with self._partial_lock:
            self.entries_failed = self.entries_dropped = self.calls_altered = 0

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def forwarded(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._forwarded)

    def injected(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._injected)

    def fired(self, rule: Rule) -> int:
        """How often `rule` (an equal rule) broke a request since the last `reset_counts`."""
        with self._lock:
            return self._fired[rule]

    def start(self) -> str:
        """Listen on a free loopback port; returns (and sets) `url`."""
        if self._server is not None:
            return self.url
        server = Server(self.upstream, self)
        self._server = server
        self.url = f"http://{HOST}:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            args=(0.05,),  # shutdown() waits up to one poll interval
            name=f"fault-proxy-{self.url}",
            daemon=True,
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop listening and cut open client connections; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_clients()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- asked by the server, per request ----------------------------------------------------

    @property
    def partial(self) -> PartialFailure | None:
        """The partial PutRecords failures set (`set_partial`), if any."""
        return self._partial

    def decide(self, call: Call) -> Rule | None:
        """Count the request and pick the first rule that fires on it, counting that too."""
        with self._lock:
            self._counts[call.service, call.op] += 1
            for active in self._rules:
                if active.fires(call):
                    self._injected[call.service, call.op] += 1
                    self._fired[active.rule] += 1
                    return active.rule
            return None

    def count_forwarded(self, call: Call) -> None:
        with self._lock:
            self._forwarded[call.service, call.op] += 1

    def choose_failures(self, n: int) -> tuple[list[int], PartialFailure | None]:
        """Which of n entries fail in this PutRecords call (and how), or none."""
        with self._partial_lock:
            partial = self._partial
            if partial is None or self._partial_left == 0:
                return [], None
            failed = [i for i in range(n) if self._partial_rng.random() < partial.probability]
            if failed and self._partial_left is not None:
                self._partial_left -= 1
            if failed:
                self.calls_altered += 1
                self.entries_failed += len(failed)
                if not partial.applied:
                    self.entries_dropped += len(failed)
            return failed, partial
