"""`pagedvk bench --suite`: decode timed over cache dtypes x shapes x backends, beside the read kernel measured
in the same process; the record is written as JSON and plotted (matplotlib, the optional `bench` extra).

Each (shape, dtype)'s inputs are allocated once, timed by every backend, and freed before the next, in the
order the record's "order" lists: on some drivers a shape's speed depends on what was allocated before it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from .. import __version__
from ..runtime.selection import get_device
from . import bench

PLOT_HINT = "pip install pagedvk[bench]"


def commit() -> str | None:
    """The git commit pagedvk runs from ("+dirty" with uncommitted changes), or None outside a checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def run(shapes, dtypes, backends, *, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, iters=20,
        repeats=3, layers=None, device=None, progress=False, on_row=None) -> dict:
    """Time every (shape, dtype, backend) after measuring the read kernel; returns the record written as JSON.
    on_row(row) is called as each row is done."""
    device = get_device(device)
    info = device.info
    ceiling = bench.read_bandwidth(device, iters=iters, progress=progress)
    record = {"device": info.name, "driver": f"{info.driver} {info.driver_version}".strip(),
              "pagedvk": __version__, "commit": commit(), "read": ceiling,
              "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
              "block_size": block_size, "order": [], "rows": []}
    for num_seqs, context in shapes:
        for dtype in dtypes:
            shape = bench.DecodeShape(num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_size=head_size, block_size=block_size, context=context, dtype=dtype)
            record["order"].append(f"{num_seqs}x{context} {dtype}")
            with bench.DecodeInputs(shape, layers, device, progress=progress) as inputs:
                for backend in backends:
                    row = bench.time_decode(inputs, backend, iters, repeats=repeats, progress=progress)
                    row["fraction_of_read"] = row["GBps"] / ceiling["GBps"]
                    record["rows"].append(row)
                    if on_row:
                        on_row(row)
    return record


def plot_series(record: dict) -> dict:
    """What the plot draws: per dtype, the shapes as "BATCHxCONTEXT" ordered by KV bytes (ties by context),
    and per backend the percentage of the read kernel at each shape (None where a shape was not run)."""
    shapes = sorted({(r["num_seqs"], r["context"]) for r in record["rows"]}, key=lambda s: (s[0] * s[1], s[1]))
    series = {}
    for r in record["rows"]:
        panel = series.setdefault(r["dtype"], {"shapes": [f"{b}x{c}" for b, c in shapes], "lines": {}})
        line = panel["lines"].setdefault(r["backend"], [None] * len(shapes))
        line[shapes.index((r["num_seqs"], r["context"]))] = 100 * r["fraction_of_read"]
    return series


def plot(record: dict, path) -> bool:
    """A PNG of plot_series(record), one panel per dtype; False (nothing written) without matplotlib."""
    try:
        from matplotlib.figure import Figure   # no pyplot: no GUI backend, no global state
    except ImportError:
        return False
    series = plot_series(record)
    fig = Figure(figsize=(1 + 3.6 * len(series), 4.2), layout="constrained")
    axes = fig.subplots(1, len(series), sharey=True, squeeze=False)[0]
    for ax, (dtype, panel) in zip(axes, series.items()):
        x = range(len(panel["shapes"]))
        for backend, percent in panel["lines"].items():
            ax.plot(x, [float("nan") if p is None else p for p in percent], marker="o", label=backend)
        ax.set_xticks(x, panel["shapes"], rotation=45, ha="right")
        ax.set_title(dtype)
        ax.set_xlabel("batch x context (by KV bytes)")
        ax.set_ylim(0, 100)   # shared by every panel: set per panel, the first panel's data would clip the rest
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of the read kernel's bandwidth")
    axes[0].legend()
    fig.suptitle(f"pagedvk decode on {record['device']}: read kernel {record['read']['GBps']:.0f} GB/s, "
                 f"{record['num_heads']}/{record['num_kv_heads']} heads, head {record['head_size']}, "
                 f"block {record['block_size']}")
    fig.savefig(path, dpi=110)
    return True


def table(record: dict) -> str:
    """The rows as a Markdown table, for BENCHMARKS.md."""
    lines = ["| dtype | backend | batch | context | GPU median | GB/s | of read BW | rel. error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        lines.append(f"| {r['dtype']} | {r['backend']} | {r['num_seqs']} | {r['context']} | {r['median_us']:.1f} us "
                     f"| {r['GBps']:.1f} | {100 * r['fraction_of_read']:.0f}% | {r['rel_error']:.1e}"
                     f"{'' if r['ok'] else ' FAILED'} |")
    return "\n".join(lines)
