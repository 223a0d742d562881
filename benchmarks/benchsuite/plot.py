"""The figure: scaling efficiency against workers, and bandwidth bars per contender."""

from __future__ import annotations

from benchsuite.contenders import CONTENDERS, ONE_STREAM
from benchsuite.report.format import GB, point_value, points_of


def write_plot(path: str, all_results: dict) -> str:
    """Scaling (items/s vs W) and bandwidth (GB/s per contender) figure; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed, no figure written"
    fig, (ax_scaling, ax_bw) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [2, 3]})
    scaling = all_results.get("scaling")
    if scaling:
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
    else:
        ax_scaling.set_title("scaling: not run")
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"figure written to {path}"


