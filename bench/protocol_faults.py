"""Crash points, speculative twins and zombies for `bench.protocol`: wrappers around the
real functions of the commit path, in place only while their step (or zombie) lives, and
acting only in the thread that installed them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shardless.changelog.durable import DurableState
from shardless.processor.runtime.stores import StoreCache
from shardless.state.store import SliceStore


class Crash(RuntimeError):
    """A worker dies at a crash point."""


@contextlib.contextmanager
def patched(owner: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    real = owner.__dict__[name]
    setattr(owner, name, make(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def after_upload(
    act: Callable[[], None], landed: Callable[[], None] | None = None
) -> Iterator[None]:
    """Call `act` in this thread when, after its commit's segment upload, it first sends its
    DynamoDB write (either commit path: the heads' `transact`, a link's `send`); with
    `landed`, call that once that write has returned. Writes before the upload (a chain's
    takeover) pass untouched."""
    me = threading.current_thread()
    uploaded, acted = threading.Event(), threading.Event()

    def upload(real: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            out = real(self, *a, **k)
            if threading.current_thread() is me:
                uploaded.set()
            return out

        return wrapper

    def write(real: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            mine = threading.current_thread() is me and uploaded.is_set() and not acted.is_set()
            if mine:
                acted.set()
                act()
            out = real(self, *a, **k)
            if mine and landed is not None:
                landed()
            return out

        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(DurableState, "upload", upload))
        stack.enter_context(patched(DurableState, "transact", write))
        stack.enter_context(patched(DurableState, "send", write))
        yield


@contextlib.contextmanager
def crash_point(where: str | None) -> Iterator[None]:
    """Raise Crash in this thread: after the segment PUT ("s3"), after the DynamoDB commit
    ("ddb"), after the local apply ("local")."""
    if where is None:
        yield
        return
    me = threading.current_thread()
    committed = threading.Event()

    def crash() -> None:
        raise Crash("after the segment PUT")

    def store_commit(real: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if threading.current_thread() is me and committed.is_set():
                raise Crash("after the DynamoDB commit")
            return real(self, *a, **k)

        return wrapper

    def remember(real: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if threading.current_thread() is me:
                raise Crash("after the local apply")
            return real(self, *a, **k)

        return wrapper

    with contextlib.ExitStack() as stack:
        if where == "s3":
            stack.enter_context(after_upload(crash))
        elif where == "ddb":
            stack.enter_context(after_upload(lambda: None, landed=committed.set))
            stack.enter_context(patched(SliceStore, "commit", store_commit))
        elif where == "local":
            stack.enter_context(patched(StoreCache, "remember", remember))
        else:
            raise ValueError(f"no crash point {where!r}")
        yield


@contextlib.contextmanager
def before_first_commit(fn: Callable[[], None]) -> Iterator[None]:
    """Run `fn` once, when this thread first reaches its commit (its segment upload)."""
    me = threading.current_thread()
    fired = []

    def upload(real: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if threading.current_thread() is me and not fired:
                fired.append(1)
                fn()
            return real(self, *a, **k)

        return wrapper

    with patched(DurableState, "upload", upload):
        yield
        if not fired:
            fn()  # the first attempt committed nothing: the copy runs after it


@contextlib.contextmanager
def stall_commit(arrived: threading.Event, release: threading.Event) -> Iterator[None]:
    """Hold this thread after its segment PUT, before its DynamoDB write."""

    def hold() -> None:
        arrived.set()
        release.wait(600)

    with after_upload(hold):
        yield
