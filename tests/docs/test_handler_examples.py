"""The ```python blocks of docs/handlers.md run, so the page cannot drift from the code.

Each block runs on its own (its imports included), from the repository root. Then every
`test_*` function it defines is called, and a block that defines a handler (`handler = ...`
or `process`, as an app file would) without driving it through a `TestDriver` itself is
driven through one: a few records of the shape `shardless produce` writes, over clocks
moved a day on, and a restart. A block may be left out only with the HTML comment
`<!-- not run: why -->` on the line right before its fence; each one left out is reported
as a skipped test naming its line. A failure names the block's line in the page and the
line of the statement that raised.
"""

from __future__ import annotations

import re
import textwrap
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardless import TestDriver
from shardless.processor.api.handlers import HandlerFactory

ROOT = Path(__file__).resolve().parents[2]
DOC = "docs/handlers.md"
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run\b")
NOT_RUN_WHY = re.compile(r"^\s*<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
START = 1_700_000_000_000
DAY = 24 * 3600_000


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None = None  # why, when marked `<!-- not run: why -->`


class BlockFailed(AssertionError):
    """A block raised: the message names where, in the page."""


def python_blocks(text: str) -> list[Block]:
    """Every ```python block of a markdown text, in order; a `not run` marker anywhere but
    right before such a block, or without a reason, is an error naming its line."""
    lines = text.splitlines()
    blocks: list[Block] = []
    used: set[int] = set()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"line {i + 1}: a ``` block is never closed")
        if fence[2] == "python":
            why = None
            if i and NOT_RUN.match(lines[i - 1]):
                marked = NOT_RUN_WHY.match(lines[i - 1])
                if not marked:
                    raise ValueError(f"line {i}: write `<!-- not run: why -->`, with a reason")
                why = marked[1]
                used.add(i - 1)
            blocks.append(Block(i + 1, textwrap.dedent("\n".join(lines[i + 1 : end])), why))
        i = end + 1
    stray = [n + 1 for n, line in enumerate(lines) if NOT_RUN.match(line) and n not in used]
    if stray:
        raise ValueError(f"line {stray[0]}: a `not run` marker not right before a ```python block")
    return blocks


def summary(blocks: list[Block], source: str) -> str:
    """How many blocks run and which do not, and why: a block left out must show."""
    left = [b for b in blocks if b.not_run]
    text = f"{source}: {len(blocks)} python blocks, {len(blocks) - len(left)} run, "
    text += f"{len(left)} not run"
    return text + "".join(f"; line {b.line}: {b.not_run}" for b in left)


def handler_of(namespace: dict[str, Any]) -> HandlerFactory | None:
    """The handler a block defines, found as `load_handler` finds an app file's."""
    if namespace.get("handler") is not None:
        return HandlerFactory(namespace["handler"])
    if callable(namespace.get("process")):
        return HandlerFactory(namespace["process"], on_timer=namespace.get("on_timer"))
    return None


def drive(factory: HandlerFactory) -> None:
    """A few records through the handler, clocks moved on so its timers and TTLs come due,
    and a restart in between."""
    with TestDriver(factory, slices=4, start_ms=START) as t:
        for i, user in enumerate(["user-1", "user-2", "user-1"]):
            t.send(user, event(i, user), event_time_ms=START + i)
        t.run_batch()
        t.advance(3600_000)
        t.advance_watermark(START + 3600_000)
        t.run_batch()
        t.restart()
        t.send("user-1", event(3, "user-1"))
        t.run_batch()
        t.advance(DAY)
        t.advance_watermark(START + DAY)
        t.run_batch()


def event(i: int, user: str) -> dict[str, Any]:
    """A record as `shardless produce` writes it."""
    return {
        "id": f"e{i}",
        "user": user,
        "ts": START + i,
        "action": "view",
        "page": f"/p{i}",
        "category": "books",
        "amount": i + 1,
    }


def run_block(block: Block, source: str) -> None:
    """Run the block, its `test_*` functions, and its handler if it does not drive it."""
    code = compile("\n" * block.line + block.code + "\n", source, "exec")
    namespace: dict[str, Any] = {"__name__": f"doc_block_line_{block.line}"}
    try:
        exec(code, namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value):
                value()
        factory = handler_of(namespace)
        if factory is not None and "TestDriver(" not in block.code:
            drive(factory)
    except Exception as exc:
        raise BlockFailed(
            f"{source} line {block.line}: the ```python block there failed"
            f"{failing_line(exc, block, source)}: {type(exc).__name__}: {exc}"
        ) from exc


def failing_line(exc: BaseException, block: Block, source: str) -> str:
    """` at line N (`statement`)`: the block's deepest frame in the exception and its causes
    (a handler's error reaches the test wrapped by the runtime)."""
    found = None
    seen: BaseException | None = exc
    while seen is not None:
        lines = [f.lineno for f in traceback.extract_tb(seen.__traceback__) if f.filename == source]
        found = lines[-1] if lines else found
        seen = seen.__cause__ or seen.__context__
    if found is None:
        return ""
    text = block.code.splitlines()[found - block.line - 1].strip()
    return f" at line {found} (`{text}`)"


# -- docs/handlers.md ------------------------------------------------------------------------

BLOCKS = python_blocks((ROOT / DOC).read_text())


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line-{b.line}" for b in BLOCKS])
def test_handler_doc_block_runs(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.not_run:
        pytest.skip(f"{DOC} line {block.line}: not run: {block.not_run}")
    monkeypatch.chdir(ROOT)  # as a user's tests run from their project's root
    run_block(block, DOC)


def test_blocks_not_run_are_counted_and_reported() -> None:
    """Each is also a skipped test above; the count shows in the warnings summary."""
    assert len(BLOCKS) >= 7, summary(BLOCKS, DOC)
    if any(b.not_run for b in BLOCKS):
        warnings.warn(summary(BLOCKS, DOC), stacklevel=1)


def test_the_page_has_runnable_blocks_for_each_testdriver_ability() -> None:
    run = "\n".join(b.code for b in BLOCKS if not b.not_run)
    for call in ("set_state(", "set_map_state(", "advance_watermark(", "with TestDriver("):
        assert call in run, f"{DOC} has no block that runs `{call}`"


# -- the runner, on small pages --------------------------------------------------------------

PAGE = """\
# A page

```python
x = 1
assert x == 1
```

```
not python: never run
```

<!-- not run: needs a live stream -->
```python
import nothing_here
```

```python
value = 2
raise ValueError("boom")
```
"""


def test_python_blocks_are_found_with_their_lines_and_not_run_markers() -> None:
    blocks = python_blocks(PAGE)
    assert blocks == [
        Block(3, "x = 1\nassert x == 1"),
        Block(13, "import nothing_here", "needs a live stream"),
        Block(17, 'value = 2\nraise ValueError("boom")'),
    ]
    assert summary(blocks, "page.md") == (
        "page.md: 3 python blocks, 2 run, 1 not run; line 13: needs a live stream"
    )


@pytest.mark.parametrize(
    "page, error",
    [
        ("<!-- not run: x -->\n\n```python\npass\n```\n", "line 1: a `not run` marker not right"),
        ("<!-- not run -->\n```python\npass\n```\n", "line 1: write `<!-- not run: why -->`"),
        ("text\n```python\npass\n", "line 2: a ``` block is never closed"),
    ],
    ids=["marker-apart", "marker-without-reason", "open-fence"],
)
def test_misplaced_markers_and_open_fences_are_errors(page: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        python_blocks(page)


def test_a_block_that_raises_fails_naming_its_line_and_the_statement() -> None:
    blocks = python_blocks(PAGE)
    run_block(blocks[0], "page.md")
    with pytest.raises(BlockFailed) as failed:
        run_block(blocks[2], "page.md")
    assert str(failed.value) == (
        "page.md line 17: the ```python block there failed at line 19 "
        '(`raise ValueError("boom")`): ValueError: boom'
    )


@pytest.mark.parametrize(
    "code, where",
    [
        ("n = 1\nassert n == 2, 'n is 1'", "line 1: the ```python block there failed at line 3"),
        (
            "def test_it():\n    assert False, 'called'",
            "failed at line 3 (`assert False, 'called'`)",
        ),
    ],
    ids=["assert", "test-function"],
)
def test_a_failing_assert_or_test_function_names_its_line(code: str, where: str) -> None:
    with pytest.raises(BlockFailed, match=re.escape(where)):
        run_block(python_blocks(f"```python\n{code}\n```\n")[0], "page.md")


HANDLER = """\
Text.

```python
def process(event, ctx):
    ctx.timers.set(ctx.now_ms + 60_000)


def on_timer(timer, ctx):
    raise RuntimeError("fired " + timer.key)
```
"""


def test_a_handler_block_is_driven_until_its_timers_fire() -> None:
    with pytest.raises(BlockFailed) as failed:
        run_block(python_blocks(HANDLER)[0], "page.md")
    message = str(failed.value)
    assert message.startswith(
        "page.md line 3: the ```python block there failed at line 9 "
        '(`raise RuntimeError("fired " + timer.key)`): ProcessorError: on_timer failed for key'
    )
    assert re.search(r"RuntimeError: fired user-[12]$", message)


def test_a_block_that_drives_its_handler_itself_is_not_driven_again() -> None:
    code = """\
from shardless import TestDriver


def process(event, ctx):
    assert event.data == b"only this", event.data
    ctx.emit("ok")


with TestDriver(process) as t:
    t.send("k", b"only this")
    assert t.run_batch() == [("k", "ok")]
"""
    run_block(python_blocks(f"```python\n{code}```\n")[0], "page.md")
