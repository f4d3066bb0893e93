"""The world `bench.protocol` drives: one small application, its workers, its queries and
the oracle (a plain fold of the accepted batches).

Every step calls the real runtime (`GroupRunner.run`), the real driver functions
(`shardless.processor.driver.progress`) and the real tools (`shardless.changelog.rollback`,
`shardless.changelog.gc`, `state restore`) in this process, against the emulators the environment
points at. Crash points, speculative twins and zombies are wrappers around the real functions, in
place only while their step (or their zombie) lives.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.protocol_app import FAR_MS, T0, Fold, Rec, Spec, frame, now_of, on_timer, process
from bench.protocol_faults import Crash, before_first_commit, crash_point, stall_commit
from shardless.changelog import aws, gc, lease, resources
from shardless.changelog import durable as durable_module
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError
from shardless.changelog.layout import AppLocation, head_item
from shardless.changelog.restore import identity, restore_many
from shardless.changelog.restore_jobs import RestoreJob
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import progress, takeover
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
from shardless.processor.runtime.grouping import group_slices
from shardless.processor.runtime.routing import route
from shardless.processor.runtime.stores import close_caches
from shardless.processor.tools import state_cli
from shardless.state import encoding
from shardless.state.keys import data_key, record_key
from shardless.state.store import SliceStore


class Violation(Exception):
    """An invariant broke."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.message = message


REFUSALS = (ProcessorError, ChangelogError)
Step = list[Any]


@dataclass
class Query:
    """A Spark query (a checkpoint) as its driver sees it."""

    id: str
    groups: int
    cursor: int  # the input batch its current Spark batch reads
    batch: int = 0  # its current Spark batch id
    fenced: list[str] = field(default_factory=list)  # what `register` returned
    pending: dict[int, dict] = field(default_factory=dict)  # Spark's group state
    done: dict[int, tuple[list, dict]] = field(default_factory=dict)  # group -> outputs, pending
    dead: bool = False  # its driver stopped (a refusal it cannot get past)
    start_from: dict | None = None  # the record a COMMITTED start continued
    woken: tuple[int, ...] = ()  # slices its first batch wakes for their timers
    before: dict[int, dict] = field(default_factory=dict)  # Spark's state before the last batch


@dataclass
class Accepted:
    query: str
    batch: int
    index: int  # the input batch
    timers: list[tuple[str, int]]  # timer outputs of the batch
    generation: int = 0  # the application (re-sliced generation) it was accepted in


class World:
    """One run: a fresh application, its workers, queries and the oracle."""

    def __init__(self, spec: Spec, inputs: list[list[Rec]], root: Path) -> None:
        self.spec = spec
        self.input = inputs
        self.root = root
        self.app = f"pr-{uuid.uuid4().hex[:12]}"
        self.loc = AppLocation.default(self.app)
        self.apps = [self.loc]  # every generation, dropped at the end
        resources.ensure(self.loc, spec.slices)
        self.queries: list[Query] = []
        self.lineage: list[Accepted] = []
        self.zombie: tuple[threading.Thread, threading.Event, threading.Event, int] | None = None
        self.zombie_result: list[Any] = []
        self.refused = 0
        self.gc_runs = 0
        # the hours an aged gc lets pass, for every clock the protocol reads (a zombie's
        # uploads stay as old as they were when it stalled)
        self.clock_offset_ms = 0
        self._real_now_ms = durable_module._now_ms
        offset = lambda: self.clock_offset_ms  # noqa: E731
        durable_module._now_ms = lambda: self._real_now_ms() + offset()
        lease._now_ms = durable_module._now_ms
        self.outcomes: list[str] = []  # per step: ok, skip, refused: <why>
        self._checked: dict[int, tuple[bytes, dict[str, Any]]] = {}
        self.handler = HandlerFactory(process, on_timer=on_timer)

    # -- helpers --

    def worker_dir(self, w: int) -> Path:
        return self.root / f"w{w}"

    def runner(self, w: int) -> GroupRunner:
        cfg = RuntimeConfig(
            self.loc,
            self.spec.slices,
            str(self.worker_dir(w)),
            snapshot_every=self.spec.snapshot_every,
            keep_snapshots=self.spec.keep_snapshots,
            transfer_process_bytes=None,
            commit_format=self.spec.commit_format,
            chain_length=self.spec.chain_length,
        )
        return GroupRunner(self.handler, cfg)

    def kill(self, w: int) -> None:
        """The worker's process dies: its open stores are closed (its files stay)."""
        close_caches(str(self.worker_dir(w)))

    def busy(self, w: int) -> bool:
        return self.zombie is not None and self.zombie[3] == w

    def live(self, qi: int) -> Query | None:
        if 0 <= qi < len(self.queries):
            q = self.queries[qi]
            if not q.dead and q.cursor < len(self.input):
                return q
        return None

    def attempt(self, q: Query, g: int, w: int) -> tuple[list, dict]:
        """One task attempt of group g of q's current batch on worker w."""
        only = group_slices(g, self.spec.slices, q.groups)
        woken = q.woken if q.batch == 0 else ()
        pdf = frame(self.input[q.cursor], self.spec.slices, only, woken)
        out, pending = self.runner(w).run(
            g, q.id, q.batch, pdf, dict(q.pending.get(g, {})), now_of(q.cursor)
        )
        rows = out[out.kind == "out"]
        outs = sorted(zip(rows.key.tolist(), rows.value.tolist(), strict=True))
        return outs, pending

    def refuse(self, why: BaseException | str) -> str:
        self.refused += 1
        text = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        return f"refused: {text[:300]}"

    def settle(self, q: Query, g: int, outs: list, pending: dict) -> None:
        """A successful attempt: Spark keeps its outputs (all attempts must agree)."""
        before = q.done.get(g)
        if before is not None and before[0] != outs:
            raise Violation(
                "attempts_disagree",
                f"two successful attempts of query {q.id[:8]} batch {q.batch} group {g} "
                f"emitted different outputs: {before[0][:4]} vs {outs[:4]}",
            )
        q.done[g] = (outs, pending)

    # -- steps --

    def step(self, step: Step) -> str:
        kind, *args = step
        fn: Callable[..., str] = getattr(self, f"do_{kind}")
        return fn(*args)

    def do_start(self, groups: int) -> str:
        """A new checkpoint: the first query, else one started with COMMITTED."""
        qid = f"q{len(self.queries):07d}-{uuid.uuid4().hex}"
        if not self.queries:
            takeover.register(self.loc, qid, 0, None)
            self.queries.append(Query(qid, groups, 0, woken=self.wake()))
            return "ok"
        try:
            found, positions = takeover.committed_start(self.loc)
        except REFUSALS as exc:
            if progress.latest(self.loc) is not None:
                return self.refuse(exc)
            # no batch completed, or the record was withdrawn by a roll-back to a batch
            # without one: the operator starts where the state stands (AT_TIMESTAMP), saying
            # that records may count again
            found, positions = None, {}
        if found is not None:
            cursor = int(positions["s/shardId-0"]["after"]) + 1
        else:
            cursor = self.lineage[-1].index + 1 if self.lineage else 0
        start_from = {"query": found["query"], "batch": found["batch"]} if found else None
        more = {}
        if found is None and "recount" in inspect.signature(takeover.register).parameters:
            more["recount"] = True
        try:
            fenced = takeover.register(self.loc, qid, 0, start_from, **more)
        except REFUSALS as exc:
            return self.refuse(exc)
        self.queries.append(
            Query(qid, groups, cursor, fenced=fenced, start_from=start_from, woken=self.wake())
        )
        self.check_exact("committed_start")
        return "ok"

    def wake(self) -> tuple[int, ...]:
        """The slices a new checkpoint's first batch wakes
        (`shardless.processor.driver.timer_source`, when
        the product has it), fixed when the batch is planned."""
        try:
            from shardless.processor.driver.timer_source import pending_slices
        except ImportError:
            return ()
        return tuple(pending_slices(self.loc, self.spec.slices))

    def do_run(self, qi: int, g: int, w: int, crash: str | None = None) -> str:
        q = self.live(qi)
        if q is None or g >= q.groups or self.busy(w):
            return "skip"
        try:
            with crash_point(crash):
                outs, pending = self.attempt(q, g, w)
        except Crash:
            self.kill(w)
            return f"crashed after {crash}"
        except REFUSALS as exc:
            return self.refuse(exc)
        self.settle(q, g, outs, pending)
        return "ok" if crash is None else "ok (nothing to commit: no crash point reached)"

    def idle(self, q: Query, g: int) -> bool:
        """Whether Spark would leave group g out of q's current batch: no records for it,
        no timer pending, no slice of it to wake."""
        only = group_slices(g, self.spec.slices, q.groups)
        woken = q.woken if q.batch == 0 else ()
        return (
            not q.pending.get(g)
            and frame(self.input[q.cursor], self.spec.slices, only, woken) is None
        )

    def do_idle(self, qi: int, g: int) -> str:
        """Spark does not call an idle group: the batch is done for it with no outputs, and
        the worker that ran it last learns nothing of the batch."""
        q = self.live(qi)
        if q is None or g >= q.groups or g in q.done or not self.idle(q, g):
            return "skip"
        q.done[g] = ([], {})
        return "ok"

    def do_twin(self, qi: int, g: int, w1: int, w2: int) -> str:
        """A speculative copy: w2's attempt runs whole while w1's waits at its commit."""
        q = self.live(qi)
        if q is None or g >= q.groups or w1 == w2 or self.busy(w1) or self.busy(w2):
            return "skip"
        results: list[Any] = []

        def second() -> None:
            try:
                results.append(self.attempt(q, g, w2))
            except REFUSALS as exc:
                results.append(exc)

        try:
            with before_first_commit(second):
                first: Any = self.attempt(q, g, w1)
        except REFUSALS as exc:
            first = exc
        said = []
        for r in [*results, first]:
            if isinstance(r, BaseException):
                said.append(self.refuse(r))
            else:
                self.settle(q, g, *r)
                said.append("ok")
        return "; ".join(said)

    def do_zombie(self, qi: int, g: int, w: int) -> str:
        """An attempt that stalls after its segment PUT, until `resume`."""
        q = self.live(qi)
        if q is None or g >= q.groups or self.zombie is not None:
            return "skip"
        arrived, release = threading.Event(), threading.Event()
        self.zombie_result = []
        query = Query(q.id, q.groups, q.cursor, q.batch, pending=dict(q.pending), woken=q.woken)

        def body() -> None:
            try:
                with stall_commit(arrived, release):
                    self.zombie_result.append(self.attempt(query, g, w))
            except BaseException as exc:  # noqa: BLE001 - reported at resume
                self.zombie_result.append(exc)
            arrived.set()

        t = threading.Thread(target=body, name="protocol-zombie", daemon=True)
        t.start()
        arrived.wait(60)
        self.zombie = (t, arrived, release, w)
        return "stalled" if t.is_alive() else "finished at once"

    def do_resume(self) -> str:
        if self.zombie is None:
            return "skip"
        t, _, release, _ = self.zombie
        release.set()
        t.join(120)
        self.zombie = None
        found = self.zombie_result[0] if self.zombie_result else None
        if isinstance(found, REFUSALS):
            return self.refuse(found)
        if isinstance(found, BaseException):
            raise Violation("unexpected_error", f"the zombie: {type(found).__name__}: {found}")
        return "ok (its outputs are discarded: Spark gave up on it)"

    def do_record(self, qi: int) -> str:
        """The driver records the batch once every group succeeded."""
        q = self.live(qi)
        if q is None or len(q.done) < q.groups:
            return "skip"
        try:
            progress.record(
                self.loc,
                {
                    "query": q.id,
                    "batch": q.batch,
                    "positions": {"s/shardId-0": {"after": str(q.cursor), "done": False}},
                    "initial": {"type": "TRIM_HORIZON"},
                    "offset": {"run": q.id[:8], "n": q.batch + 1},
                    "fenced": q.fenced,
                },
            )
        except REFUSALS as exc:
            q.dead = True
            return self.refuse(exc)
        self.accept(q)
        return "ok"

    def accept(self, q: Query) -> None:
        outs = [o for g in sorted(q.done) for o in q.done[g][0]]
        last = self.lineage[-1] if self.lineage else None
        if last is not None and (last.query, last.batch) == (q.id, q.batch):
            self.lineage.pop()  # recorded again after a restart: the same batch, once
        fold = self.fold()
        expected = fold.apply(self.input[q.cursor])
        got: dict[int, int] = {}
        timers: list[tuple[str, int]] = []
        for key, value in outs:
            v = json.loads(value)
            if "timer" in v:
                timers.append((key, v["timer"]))
                if v["timer"] > now_of(q.cursor):
                    raise Violation("timer_early", f"timer {key}@{v['timer']} fired early")
            elif v["id"] in got:
                raise Violation("outputs", f"record {v['id']} emitted twice in one batch")
            else:
                got[v["id"]] = v["n"]
        if got != expected:
            diff = {i: (got.get(i), expected.get(i)) for i in set(got) | set(expected)}
            diff = {i: d for i, d in diff.items() if d[0] != d[1]}
            raise Violation(
                "outputs",
                f"query {q.id[:8]} batch {q.batch} (input {q.cursor}): outputs differ from the "
                f"fold's, id: (emitted n, fold n) {dict(sorted(diff.items())[:6])}",
            )
        seen = {t for a in self.lineage for t in a.timers}
        twice = [t for t in timers if t in seen]
        if twice or len(set(timers)) != len(timers):
            raise Violation("timer_twice", f"timers fired again in accepted outputs: {twice}")
        self.lineage.append(Accepted(q.id, q.batch, q.cursor, timers, len(self.apps) - 1))
        q.before = q.pending
        q.pending = {g: q.done[g][1] for g in q.done}
        q.done = {}
        q.batch += 1
        q.cursor += 1

    def do_restart(self, qi: int, again: bool, groups: int | None = None) -> str:
        """The query's driver restarts from its checkpoint: every group of the current
        batch runs again; `again`: Spark's commit of the batch just recorded was lost, so
        it runs (and records) that batch again; `groups`: with another group count."""
        if not 0 <= qi < len(self.queries) or self.queries[qi].dead:
            return "skip"
        q = self.queries[qi]
        last = self.lineage[-1] if self.lineage else None
        if again:
            if last is None or (last.query, last.batch) != (q.id, q.batch - 1):
                return "skip"
            q.batch, q.cursor, q.pending = q.batch - 1, q.cursor - 1, q.before
        elif q.cursor >= len(self.input):
            return "skip"
        q.done = {}
        if groups is not None:
            q.groups, q.pending = groups, {}
        try:
            takeover.register(self.loc, q.id, q.batch, q.start_from if q.batch == 0 else None)
        except REFUSALS as exc:
            q.dead = True
            return self.refuse(exc)
        return "ok"

    def do_wipe(self, w: int) -> str:
        if self.busy(w):
            return "skip"
        self.kill(w)
        shutil.rmtree(self.worker_dir(w), ignore_errors=True)
        return "ok"

    def do_move(self, w1: int, w2: int) -> str:
        """Worker w1's local directory ends up as w2's (a disk moved between hosts)."""
        if w1 == w2 or self.busy(w1) or self.busy(w2) or not self.worker_dir(w1).exists():
            return "skip"
        self.kill(w1)
        self.kill(w2)
        shutil.rmtree(self.worker_dir(w2), ignore_errors=True)
        shutil.move(str(self.worker_dir(w1)), str(self.worker_dir(w2)))
        return "ok"

    def do_rollback(self, back: int) -> str:
        """`state rollback --apply` to an accepted batch `back` batches before the newest
        (its progress record becomes the latest)."""
        if back >= len(self.lineage) or not self.current(self.lineage[-1 - back]):
            return "skip"
        target = self.lineage[-1 - back]
        return self.roll_back(target.query, target.batch, len(self.lineage) - back)

    def do_rollback_unrecorded(self, qi: int) -> str:
        """`state rollback --apply` to before query qi's first batch: a target without a
        progress record."""
        if not 0 <= qi < len(self.queries):
            return "skip"
        qid = self.queries[qi].id
        keep = next((i for i, a in enumerate(self.lineage) if a.query == qid), None)
        if keep is None or not self.current(self.lineage[keep]):
            return "skip"
        return self.roll_back(qid, -1, keep)

    def roll_back(self, query: str, batch: int, keep: int) -> str:
        """The operator's roll-back (`--force`: while queries run); the lineage keeps its
        first `keep` batches, and state must then be exactly their fold."""
        code, err = state_tool(
            ["state", "rollback", "--app", self.app, "--query", query, f"--batch={batch}",
             "--apply", "--force", "--json"]
        )  # fmt: skip
        if code != 0:
            return self.refuse(f"state rollback exit {code}: {err}")
        del self.lineage[keep:]
        self.check_exact("rollback")
        return "ok"

    def do_gc(self, aged: bool = True) -> str:
        """Garbage collection with deletes; `aged`: an hour passes between collections."""
        self.gc_runs += 1
        now = None
        if aged:
            self.clock_offset_ms = self.gc_runs * 2 * 3_600_000
            now = int(datetime.now(UTC).timestamp() * 1000) + self.clock_offset_ms
        try:
            report = gc.collect(self.loc, self.spec.slices, dry_run=False, now_ms=now)
        except REFUSALS as exc:
            return self.refuse(exc)
        return f"ok ({len(report.deleted)} deleted)"

    def do_restore(self, back: int, s: int) -> str:
        """`state restore --slice s --batch B --query Q` of an accepted batch, compared with
        the fold at that batch."""
        if back >= len(self.lineage) or s >= self.spec.slices:
            return "skip"
        if not self.current(self.lineage[-1 - back]):
            return "skip"
        target = self.lineage[-1 - back]
        dest = self.root / f"restore-{uuid.uuid4().hex[:8]}"
        args = [
            "state", "restore", "--app", self.app, "--slice", str(s), "--dest", str(dest),
            "--batch", str(target.batch), "--query", target.query, "--json",
        ]  # fmt: skip
        code, err = state_tool(args)
        if code != 0:
            if "no committed state" in err:
                return "ok (empty)"
            return self.refuse(f"state restore exit {code}: {err}")
        store = SliceStore(dest, {"app": self.app, "slice": s, "slices": self.spec.slices})
        try:
            found = decode_items(store)
        finally:
            store.close()
            shutil.rmtree(dest, ignore_errors=True)
        upto = self.lineage[: len(self.lineage) - back]
        fold = self.fold(upto)
        want = {k: ids for k, ids in fold.ids.items() if route(k, None, self.spec.slices) == s}
        got = {k: v["ids"] for k, v in found.items()}
        if got != want:
            raise Violation(
                "restore_at_batch",
                f"slice {s} restored at query {target.query[:8]} batch {target.batch}: "
                f"{diff_text(got, want)}",
            )
        return "ok"

    def do_reslice(self, to: int) -> str:
        """The job stops (every query), `state reslice --apply` writes the state as `to`
        slices into a new application, which the next COMMITTED start continues."""
        n = self.spec.slices
        if to == n or not (to % n == 0 or n % to == 0):
            return "skip"
        self.do_resume()
        for w in range(self.spec.workers):
            self.kill(w)
        for q in self.queries:
            q.dead = True
        target = AppLocation.default(f"pr-{uuid.uuid4().hex[:12]}")
        args = [
            "state", "reslice", "--app", self.app, "--to-app", target.app,
            "--to-slices", str(to), "--apply", "--force", "--json",
        ]  # fmt: skip
        if n == 1:
            args.append("--md5-routed")
        self.apps.append(target)  # dropped at the end even if the tool fails half-way
        code, err = state_tool(args)
        if code != 0:
            self.apps.pop()
            return self.refuse(f"state reslice exit {code}: {err}")
        self.app, self.loc = target.app, target
        self.spec = replace(self.spec, slices=to)
        self._checked = {}
        return "ok"  # commits of unrecorded batches are the next COMMITTED start's to undo

    def current(self, a: Accepted) -> bool:
        return a.generation == len(self.apps) - 1

    # -- the oracle --

    def fold(self, upto: list[Accepted] | None = None) -> Fold:
        f = Fold()
        for a in self.lineage if upto is None else upto:
            f.apply(self.input[a.index])
        return f

    def durable(self) -> dict[str, Any]:
        """Every key's state rebuilt on a fresh directory from S3 and DynamoDB alone (a
        slice whose head is unchanged since the last check is not restored again)."""
        durable = DurableState(self.loc)
        heads = durable.heads(list(range(self.spec.slices)))
        marks = {
            s: json.dumps(head_item(h), sort_keys=True, default=repr).encode()
            for s, h in heads.items()
        }
        stale = [s for s in sorted(heads) if self._checked.get(s, (b"",))[0] != marks[s]]
        with tempfile.TemporaryDirectory(dir=self.root) as scratch:
            jobs = [
                RestoreJob(
                    Path(scratch) / str(s),
                    identity(self.app, s, self.spec.slices),
                    heads[s],
                    heads[s].version,
                )
                for s in stale
            ]
            failed = []
            for done in restore_many(jobs, durable) if jobs else []:
                s = done.job.slice
                if done.error is not None or done.store is None:
                    err = done.error
                    failed.append(f"slice {s} v{heads[s].version}: {type(err).__name__}: {err}")
                    continue
                try:
                    self._checked[s] = (marks[s], decode_items(done.store))
                finally:
                    done.store.close()
        if failed:
            raise Violation("restore_failed", "; ".join(failed)[:600])
        found: dict[str, Any] = {}
        for s in sorted(heads):
            found.update(self._checked[s][1])
        return found

    def check(self) -> None:
        """After every step: accepted records once, in order; no record twice."""
        state = self.durable()
        fold = self.fold()
        accepted = {i for ids in fold.ids.values() for i in ids}
        for key, v in sorted(state.items()):
            ids, fired = v["ids"], v["fired"]
            if len(set(ids)) != len(ids):
                raise Violation("counted_twice", f"key {key}: ids {ids}")
            if len(set(fired)) != len(fired):
                raise Violation("timer_twice", f"key {key}: timers fired {fired}")
            mine = [i for i in ids if i in accepted]
            if mine != fold.ids.get(key, []):
                raise Violation(
                    "accepted_lost",
                    f"key {key}: accepted ids {fold.ids.get(key)} but state has {ids}",
                )
        missing = [k for k in fold.ids if k not in state]
        if missing:
            raise Violation("accepted_lost", f"keys {missing[:5]} missing from state")

    def check_exact(self, after: str) -> None:
        """Where the product promises clean state: exactly the fold of the lineage, and
        exactly its timers."""
        state = self.durable()
        fold = self.fold()
        got = {k: v["ids"] for k, v in state.items() if v["ids"]}
        if got != fold.ids:
            raise Violation(f"not_exact_after_{after}", diff_text(got, fold.ids))
        fired: dict[str, list[int]] = {}
        for a in self.lineage:
            for key, ts in a.timers:
                fired.setdefault(key, []).append(ts)
        got_fired = {k: sorted(v["fired"]) for k, v in state.items() if v["fired"]}
        want_fired = {k: sorted(v) for k, v in fired.items()}
        if got_fired != want_fired:
            raise Violation(f"timers_not_exact_after_{after}", diff_text(got_fired, want_fired))

    def finish(self, groups: int, worker: int) -> None:
        """A fresh COMMITTED query processes every remaining batch, then one batch far in
        the future; state must then be the fold of the whole input, every timer fired once."""
        if self.zombie is not None:
            self.outcomes.append(f"finish: resume {self.do_resume()}")
        said = self.do_start(groups)
        if not said.startswith("ok"):
            raise Violation("finish_refused", said)
        q = self.queries[-1]
        qi = len(self.queries) - 1
        while q.cursor < len(self.input):
            for g in range(q.groups):
                said = self.do_run(qi, g, worker)
                if said != "ok":
                    raise Violation("finish_refused", f"group {g}: {said}")
            said = self.do_record(qi)
            if said != "ok":
                raise Violation("finish_refused", f"record: {said}")
        outs = []
        for g in range(q.groups):
            runner = self.runner(worker)
            only = group_slices(g, self.spec.slices, q.groups)
            woken = q.woken if q.batch == 0 else ()  # no input left: this is its first batch
            pdf = frame([], self.spec.slices, only, woken)
            out, _ = runner.run(g, q.id, q.batch, pdf, dict(q.pending.get(g, {})), T0 + FAR_MS)
            rows = out[out.kind == "out"]
            outs += list(zip(rows.key.tolist(), rows.value.tolist(), strict=True))
        state = self.durable()
        want = Fold()
        for batch in self.input:
            want.apply(batch)
        got = {k: v["ids"] for k, v in state.items() if v["ids"]}
        if got != want.ids:
            raise Violation("final_state", diff_text(got, want.ids))
        timers: dict[str, list[int]] = {}
        for batch in self.input:
            for r in batch:
                if r.timer is not None:
                    timers.setdefault(r.key, []).append(r.timer)
        got_fired = {k: sorted(v["fired"]) for k, v in state.items() if v["fired"]}
        want_fired = {k: sorted(v) for k, v in timers.items()}
        if got_fired != want_fired:
            raise Violation("final_timers", diff_text(got_fired, want_fired))

    def close(self) -> None:
        if self.zombie is not None:
            with contextlib.suppress(Exception):
                self.do_resume()
        for w in range(self.spec.workers):
            self.kill(w)
        for loc in self.apps:
            drop(loc)
        durable_module._now_ms = lease._now_ms = self._real_now_ms


def drop(loc: AppLocation) -> None:
    """Delete the application's table and bucket (the one moto server serves every run)."""
    with contextlib.suppress(Exception):
        aws.client("dynamodb").delete_table(TableName=loc.table)
    with contextlib.suppress(Exception):
        s3 = aws.client("s3")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=loc.bucket, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=loc.bucket)


def state_tool(argv: list[str]) -> tuple[int, str]:
    """Run `shardless state ...` in this process; its exit code and its stderr."""
    parser = argparse.ArgumentParser()
    state_cli.add_parser(parser.add_subparsers())
    ns = parser.parse_args(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = state_cli.run(ns)
    except REFUSALS as exc:
        return 2, str(exc)
    return code, err.getvalue().strip()[:400]


def decode_items(store: SliceStore) -> dict[str, Any]:
    """Each key's value (map entries and timer index entries left out)."""
    out = {}
    for k, v in store.items():
        key = record_key(k)
        if k == data_key(key):
            out[key] = encoding.decode(v)
    return out


def diff_text(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want))
    diffs = [
        f"{k}: state {got.get(k)} fold {want.get(k)}" for k in keys if got.get(k) != want.get(k)
    ]
    return f"{len(diffs)} keys differ: " + "; ".join(diffs[:4])
