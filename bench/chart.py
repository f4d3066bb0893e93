"""The chart of `bench/results/vs_spark.json`: records per second per contender and workload.

    python -m bench.chart [bench/results/vs_spark.json] [bench/results/vs_spark.png]

Needs matplotlib (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LABELS = {
    "shardless": "shardless (counter handler, group owner processes)",
    "shardless_worker_stores": "shardless, stores in the Python workers",
    "shardless_few_slices": "shardless, 32 slices instead of 256",
    "apply_in_pandas_with_state": "applyInPandasWithState",
    "transform_with_state_in_pandas": "transformWithStateInPandas",
    "spark_sql_count": "Spark SQL groupBy().count() (JVM)",
    "python_floor": "floor: shardless's plan, a no-op Python function",
    "rocksdb_floor": "RocksDB floor: the floor keeping the counts in a store per slice",
    "handler_floor": "handler floor: the RocksDB floor calling the handler per record",
}
COLOURS = {
    "shardless": "#1b9e77",
    "shardless_worker_stores": "#66c2a5",
    "shardless_few_slices": "#a6dba0",
    "apply_in_pandas_with_state": "#7570b3",
    "transform_with_state_in_pandas": "#e7298a",
    "spark_sql_count": "#d95f02",
    "python_floor": "#999999",
    "rocksdb_floor": "#666666",
    "handler_floor": "#333333",
}


def bars(result: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(contender, label, from the second master) in drawing order."""
    few = result["config"].get("few_slices", 32)
    default = result["config"].get("slices", 256)
    labels = {**LABELS, "shardless_few_slices": f"shardless, {few} slices instead of {default}"}
    ran = {c for rates in result["workloads"].values() for c in rates}
    master = result["config"]["master"]
    out = [(c, f"{label}, {master}", False) for c, label in labels.items() if c in ran]
    if "also" in result:
        master = result["also"]["master"]
        out += [(c, f"{LABELS[c]}, {master}", True) for c in ("shardless", "spark_sql_count")]
    return out


def panels(result: dict[str, Any]) -> list[tuple[int, dict[str, Any], bool]]:
    """(records per batch, the run's result, with the second master's bars) per panel:
    the first run, then the rerun in batches of `--also-batch` records when it ran."""
    out = [(result["config"]["batch_records"], result, True)]
    if "also_batch" in result:
        again = result["also_batch"]
        out.append((again["batch_records"], {**result, "workloads": again["workloads"]}, False))
    return out


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(result)
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 5.5 * len(shown)), dpi=110, sharey=True)
    axes = axes if len(shown) > 1 else [axes]
    cfg = result["config"]
    for ax, (batch, run, with_also) in zip(axes, shown, strict=True):
        workloads = list(run["workloads"])
        series = [s for s in bars(run) if with_also or not s[2]]
        width = 0.8 / len(series)
        for i, (contender, label, also) in enumerate(series):
            source = run["also"]["workloads"] if also else run["workloads"]
            values = [source.get(w, {}).get(contender) or 0 for w in workloads]
            xs = [w + (i - (len(series) - 1) / 2) * width for w in range(len(workloads))]
            style = {"hatch": "//", "edgecolor": "white"} if also else {}
            drawn = ax.bar(xs, values, width, label=label, color=COLOURS[contender], **style)
            names = [f"{v / 1000:,.1f}k" if v else "" for v in values]
            ax.bar_label(drawn, labels=names, fontsize=7, rotation=90, padding=2)
        ax.set_yscale("log")
        ax.set_xticks(range(len(workloads)), [name.replace("_", " ") for name in workloads])
        ax.set_ylabel("records per second (log scale), steady state")
        ax.set_title(
            f"Counting per key: {cfg['records_per_workload']:,} records per workload in "
            f"batches of {batch:,}, 2 cores, RocksDB state store",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper left", ncols=2)
        ax.grid(axis="y", which="major", alpha=0.3)
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 12)  # room for the legends (axes shared)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    src = Path(args[0] if args else "bench/results/vs_spark.json")
    dst = Path(args[1] if len(args) > 1 else src.with_suffix(".png"))
    draw(json.loads(src.read_text()), dst)
    print(dst)


if __name__ == "__main__":
    main()
