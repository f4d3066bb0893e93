"""`shardless state ls|gc` over state written by the task runtime (moto over HTTP)."""

from __future__ import annotations

import json

from shardless.processor import cli
from tests.processor.runtime.test_runtime import KEYS, frame, runner


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_ls_shows_each_committed_slice_with_its_owner(location, tmp_path, capsys):
    r = runner(location, tmp_path, snapshot_every=2)
    for b in range(4):
        r.run(0, "q", b, frame(KEYS[b * 100 : (b + 1) * 100], b * 100))
    code, out = run_cli(capsys, "state", "ls", "--app", location.app, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["slices"] == 16 and len(data["heads"]) == 16
    committed = [h for h in data["heads"] if h["version"]]
    assert max(h["version"] for h in committed) == 4
    assert all(h["owner"] and h["epoch"] == 1 and h["log_entries"] for h in committed)
    assert any(h["snapshots"] for h in committed)
    code, text = run_cli(capsys, "state", "ls", "--app", location.app)
    assert f"{len(committed)} of 16 slices committed" in text


def test_gc_is_a_dry_run_unless_told(location, tmp_path, capsys):
    r = runner(location, tmp_path, snapshot_every=1, keep_snapshots=1)
    for b in range(4):
        r.run(0, "q", b, frame(KEYS[:50], b * 100))
    code, out = run_cli(capsys, "state", "gc", "--app", location.app, "--json", "--grace-s", "0")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] and report["unreferenced"] > 0
    assert report["deleted"] == report["unreferenced"]  # would delete: no grace asked
    code, out = run_cli(
        capsys, "state", "gc", "--app", location.app, "--json", "--delete", "--grace-s", "0"
    )
    assert code == 3 and "looks running" in json.loads(out)["error"]  # it just committed
    code, out = run_cli(capsys, "state", "gc", "--app", location.app, "--json", "--delete")
    assert code == 0  # the default grace period is safe beside a running job
    assert json.loads(out)["deleted"] == 0  # first sighting starts the grace period


def test_missing_application_is_a_one_line_error(aws, capsys):
    code = cli.main(["state", "ls", "--app", "never-created"])
    err = capsys.readouterr().err
    assert code == 2 and "application 'never-created' has no state" in err


def test_the_state_tools_read_a_state_committed_through_group_chains(location, tmp_path, capsys):
    """commit_format="chains": `ls` names each slice's chain, `verify --rebuild` finds every
    version restorable from every starting point, and `get` reads the fold's count."""
    from collections import Counter

    from shardless.processor.runtime.routing import route

    r = runner(location, tmp_path, snapshot_every=2, commit_format="chains", chain_length=2)
    fed: Counter = Counter()
    for b in range(6):
        keys = KEYS[b * 50 : (b + 1) * 50] + ["user-1"] * 3
        r.run(0, "q", b, frame(keys, b * 100))
        fed.update(keys)
    code, out = run_cli(capsys, "state", "ls", "--app", location.app, "--json")
    committed = [h for h in json.loads(out)["heads"] if h["version"]]
    assert code == 0 and committed
    assert all(h["chain"] and h["chain_from"] >= 1 for h in committed)
    # 6 batches, chains rolled over every 2 positions: 3 chains, the older two sealed, and
    # every slice moved to the newest (each batch touches all 16)
    chains = json.loads(out)["chains"]
    assert [(c["positions"], c["sealed"]) for c in chains] == [(2, True), (2, True), (2, False)]
    assert [c["heads"] for c in chains] == [0, 0, len(committed)]
    code, text = run_cli(capsys, "state", "ls", "--app", location.app)
    assert (
        f"chain {chains[-1]['chain']}: query q group 0 slices 0-15, 2 positions, named by" in text
    )
    hot = route("user-1", None, 16)
    assert next(h for h in committed if h["slice"] == hot)["version"] == 6
    code, out = run_cli(capsys, "state", "verify", "--app", location.app, "--rebuild", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report["problems"]
    assert report["manifests"] > 0 and report["rebuilt"] == len(committed)
    code, out = run_cli(capsys, "state", "get", "--app", location.app, "--key", "user-1", "--json")
    assert code == 0 and json.loads(out)["value"] == fed["user-1"]
