"""The figure: scaling efficiency against workers, bandwidth bars per contender, GB/s against item size."""

from __future__ import annotations

from benchsuite.contenders import CONTENDERS, ONE_STREAM
from benchsuite.report.format import GB, fmt_size, point_value, points_of


def write_plot(path: str, all_results: dict) -> str:
    """The figure of a run: scaling (efficiency vs W) and bandwidth (GB/s per contender) panels,
    and GB/s against item size when the sweep ran; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed, no figure written"
    sweep = all_results.get("sweep")
    panels = ([] if sweep and not any(s == "scaling" or s.startswith("tensor") for s in all_results)
              else [(2, plot_scaling), (3, plot_bandwidth)]) + ([(3, plot_sweep)] if sweep else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 6), squeeze=False,
                             gridspec_kw={"width_ratios": [width for width, _ in panels]})
    for ax, (_, panel) in zip(axes[0], panels):
        panel(ax, all_results)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"figure written to {path}"


def plot_scaling(ax_scaling, all_results: dict) -> None:
    """Scaling efficiency against W, one line per contender."""
    scaling = all_results.get("scaling")
    if not scaling:
        ax_scaling.set_title("scaling: not run")
        return
    sleep_s = scaling["params"]["sleep_s"]
    workers = scaling["params"]["workers_list"]
    ax_scaling.axhline(1.0, color="k", linestyle="--", linewidth=1, label="ideal (W / sleep)")
    ax_scaling.axhline(0.9, color="r", linestyle=":", linewidth=1, label="target 0.9")
    for name, outcome in scaling["contenders"].items():
        points = [p for p in ((outcome.get("data") or {}).get("points") or outcome.get("partial") or [])
                  if p.get("efficiency")]
        if points:
            ax_scaling.plot([p["workers"] for p in points], [p["efficiency"] for p in points], "o-",
                            label=name)
    ax_scaling.set(xscale="log", xlabel="workers (W)", ylabel="efficiency = items/s / (W / sleep)",
                   ylim=(0, 1.1), title=f"scaling efficiency: sleep {sleep_s * 1000:.0f} ms per item")
    ax_scaling.set_xticks(workers, [str(w) for w in workers])
    ax_scaling.minorticks_off()
    ax_scaling.legend(loc="lower left")


def plot_bandwidth(ax_bw, all_results: dict) -> None:
    """GB/s bars per contender and W, one colour per tensor scenario."""
    bw = {s: r for s, r in all_results.items() if s.startswith("tensor")}
    order = ["raw-socket", "raw-unix"] + [n for n in CONTENDERS if not n.startswith("raw-")]
    bars: dict[tuple[int, int], str] = {}  # (contender order, W) -> label; in-process moves nothing
    for res in bw.values():
        for name in res["contenders"]:
            for p in points_of(res["contenders"], name):
                if name != "in-process" and "error" not in p and p.get("bytes_per_s"):
                    label = name if name in ONE_STREAM else f"{name}\nW={p['workers']}"
                    bars[(order.index(name), p["workers"])] = label
    keys = sorted(bars)
    width = 0.8 / max(1, len(bw))
    for i, (scenario, res) in enumerate(bw.items()):
        rates = [point_value(res["contenders"], order[k[0]], "bytes_per_s", k[1]) or 0 for k in keys]
        xs = [x + i * width for x in range(len(keys))]
        ax_bw.bar(xs, [r / GB for r in rates], width,
                  label=scenario.replace("tensor", "").upper() + "iB tensors")
        for x, r in zip(xs, rates):
            if r:
                ax_bw.text(x, r / GB, f"{r / GB:.1f}", ha="center", va="bottom", fontsize=7)
    ax_bw.set_xticks([x + width * (len(bw) - 1) / 2 for x in range(len(keys))],
                     [bars[k].replace("\n", " ") for k in keys], fontsize=8, rotation=30, ha="right")
    ax_bw.set(ylabel="GB/s (1e9 bytes)",
              title="bandwidth, one host (W = workers; raw-* = one stream, one reused buffer)")
    if bw:
        ax_bw.legend()


#: The limits' colours (dashed lines), apart from the contenders' (matplotlib's cycle, C0-C9).
LIMIT_COLORS = ("black", "dimgray", "darkgoldenrod", "teal", "slateblue", "olive", "sienna", "rosybrown",
                "darkkhaki", "darkcyan")


def plot_sweep(ax, all_results: dict) -> None:
    """GB/s against item size (log-log), one line per (contender, W): each its own colour."""
    sweep = all_results["sweep"]
    sizes = sweep["params"]["sizes"]
    drawn = {"limits": 0, "contenders": 0}
    for name in sweep["contenders"]:
        for workers in sorted({p["workers"] for p in points_of(sweep["contenders"], name)}):
            measured = [(size, point_value(sweep["contenders"], name, "bytes_per_s", workers, size))
                        for size in sizes]
            measured = [(size, rate) for size, rate in measured if rate]
            if measured:
                kind = "limits" if name.startswith("raw-") or "-limit" in name else "contenders"
                color = (LIMIT_COLORS[drawn[kind] % len(LIMIT_COLORS)] if kind == "limits"
                         else f"C{drawn[kind] % 10}")
                drawn[kind] += 1
                ax.plot([size for size, _ in measured], [rate / GB for _, rate in measured],
                        "--" if kind == "limits" else "o-", color=color,
                        label=name if name in ONE_STREAM else f"{name} W={workers}")
    ax.set(xscale="log", yscale="log", xlabel="item size", ylabel="GB/s (1e9 bytes)",
           title="throughput by item size (fresh tensors; dashed: the limits; raw-* = one stream)")
    ax.set_xticks(sizes, [fmt_size(size).replace(" ", "") for size in sizes], fontsize=8)
    ax.minorticks_off()
    ax.legend(fontsize=8)
