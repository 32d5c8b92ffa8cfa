"""Summarises the benchmark runs of `make bench` into target/bench/summary.json, and draws
docs/bench/p1-window.png (throughput against window, with the ideal line),
docs/bench/p4-memory.png (peak RSS against backlog), docs/bench/p6-latency-cdf.png (press to
completed, against the provider's latency) and docs/bench/p7-capacity.png (from the recorded runs
of docs/bench/p7-runs.jsonl) when matplotlib is importable
(deploy/bench-summary.sh provides it).

Reads the JSON lines the bench scripts wrote (target/bench/window.jsonl, ceiling.jsonl,
memory.jsonl, failover.jsonl, front.jsonl, front-latencies.jsonl, profile.jsonl): one line per run; every point
is given as its median and its spread.
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spread(values):
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "runs": len(values),
    }


def window_points(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[(run["latency_ms"], run["partitions"], run["window"])].append(run)
    points = []
    for (latency, partitions, window), group in sorted(groups.items()):
        points.append(
            {
                "latency_ms": latency,
                "partitions": partitions,
                "window": window,
                "ideal_per_s": group[0]["ideal_per_s"],
                "replies_per_s": spread([r["replies_per_s"] for r in group]),
                "ratio": spread([r["ratio"] for r in group]),
                "mock_max_open": spread([r["mock_max_open"] for r in group]),
                "worker_cpu_us_per_record": spread(
                    [r["worker_cpu_us_per_record"] for r in group]
                ),
            }
        )
    return points


def ceiling_points(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[(run["binary"], run.get("batched", ""), run["window"], run["partitions"])].append(run)
    points = []
    for (binary, batched, window, partitions), group in sorted(groups.items()):
        point = {
            "binary": binary,
            "batched": batched,
            "window": window,
            "partitions": partitions,
            "replies_per_s": spread([r["replies_per_s"] for r in group]),
            "statements_per_task": spread([r["statements_per_task"] for r in group]),
            "transactions_per_task": spread([r["transactions_per_task"] for r in group]),
            "worker_cpu_us_per_record": spread([r["worker_cpu_us_per_record"] for r in group]),
        }
        ceilings = [r["pgbench_lifecycles_per_s"] for r in group if r["pgbench_lifecycles_per_s"] > 0]
        if ceilings:
            point["pgbench_lifecycles_per_s"] = spread(ceilings)
            point["ratio"] = spread([r["ratio"] for r in group if r["pgbench_lifecycles_per_s"] > 0])
        points.append(point)
    return points


def memory_points(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[run["backlog"]].append(run)
    return [
        {
            "backlog": backlog,
            "window": group[0]["window"],
            "seconds": group[0]["seconds"],
            "replies": spread([r["replies"] for r in group]),
            "peak_rss_mib": spread([r["peak_rss_kib"] / 1024 for r in group]),
            "peak_over_100_mib": spread([r["peak_over_goal"] for r in group]),
        }
        for backlog, group in sorted(groups.items())
    ]


def failover_points(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[(run["protocol"], run["session_timeout_ms"], run["lease_ms"])].append(run)
    return [
        {
            "protocol": protocol,
            "session_timeout_ms": session,
            "lease_ms": lease,
            "partitions_resumed_s": spread([r["partitions_resumed_s"] for r in group]),
            "in_flight_recovered_s": spread([r["in_flight_recovered_s"] for r in group]),
            "in_flight_at_kill": spread([r["in_flight_at_kill"] for r in group]),
            "generations_per_task": spread([r["generations_per_task"] for r in group]),
        }
        for (protocol, session, lease), group in sorted(groups.items())
    ]


def front_points(runs):
    groups = defaultdict(list)
    for run in runs:
        groups[(run["latency_ms"], run["presses"], run["concurrency"])].append(run)
    return [
        {
            "latency_ms": latency,
            "presses": presses,
            "concurrency": concurrency,
            "e2e_ms_p50": spread([r["e2e_ms_p50"] for r in group]),
            "e2e_ms_p99": spread([r["e2e_ms_p99"] for r in group]),
            "overhead_ms_p50": spread([r["overhead_ms_p50"] for r in group]),
            "provider_share": spread([r["provider_share"] for r in group]),
        }
        for (latency, presses, concurrency), group in sorted(groups.items())
    ]


def plot_memory(points, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    backlogs = [p["backlog"] for p in points]
    medians = [p["peak_rss_mib"]["median"] for p in points]
    low = [p["peak_rss_mib"]["median"] - p["peak_rss_mib"]["min"] for p in points]
    high = [p["peak_rss_mib"]["max"] - p["peak_rss_mib"]["median"] for p in points]
    ax.errorbar(backlogs, medians, yerr=[low, high], marker="o", capsize=3, label="peak RSS")
    ax.axhline(100, linestyle="--", color="grey", linewidth=0.8, label="goal: 100 MiB")
    ax.set_xscale("log")
    ax.set_ylim(0, 128)
    ax.set_xlabel("backlog (records)")
    ax.set_ylabel("MiB (median, min–max)")
    ax.set_title("Worker peak RSS against backlog, window 1,024")
    ax.grid(True, linewidth=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"bench-summary: wrote {out}", file=sys.stderr)


def plot_latency_cdf(runs, out):
    """The press-to-completed CDF of each run of the newest P6 invocation, beside the
    provider's own latency (what the user would wait with nothing in between)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    newest = runs[-1]["invocation"]
    runs = [r for r in runs if r["invocation"] == newest]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        values = sorted(r["e2e_ms"])
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post",
                label=f"run {r['run']} ({n} presses)")
    latencies = sorted({r["latency_ms"] for r in runs})
    for latency in latencies:
        ax.axvline(latency, linestyle="--", color="grey", linewidth=0.8,
                   label=f"the mock's latency: {latency} ms")
    ax.set_xlabel("press → completed over SSE (ms)")
    ax.set_ylabel("share of presses")
    ax.set_ylim(0, 1.01)
    ax.set_title("P6: what a user waits, against the provider's latency")
    ax.grid(True, linewidth=0.3)
    ax.legend(loc="lower right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"bench-summary: wrote {out}", file=sys.stderr)


def plot(points, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-summary: matplotlib missing, no plot drawn", file=sys.stderr)
        return
    series = defaultdict(list)
    for p in points:
        series[(p["latency_ms"], p["partitions"])].append(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (latency, partitions), ps in sorted(series.items()):
        ps.sort(key=lambda p: p["window"])
        windows = [p["window"] for p in ps]
        medians = [p["replies_per_s"]["median"] for p in ps]
        low = [p["replies_per_s"]["median"] - p["replies_per_s"]["min"] for p in ps]
        high = [p["replies_per_s"]["max"] - p["replies_per_s"]["median"] for p in ps]
        label = f"mock {latency} ms, {partitions} partition{'s' if partitions > 1 else ''}"
        ax.errorbar(windows, medians, yerr=[low, high], marker="o", capsize=3, label=label)
        ax.plot(
            windows,
            [w / (latency / 1000.0) for w in windows],
            linestyle="--",
            linewidth=0.8,
            color="grey",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("in-flight window (records)")
    ax.set_ylabel("replies/s (median, min–max)")
    ax.set_title("Little's law: replies/s against window (dashed: window ÷ latency)")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"bench-summary: wrote {out}", file=sys.stderr)


def plot_capacity(runs, out):
    """P7: the tasks each variant failed before and after the shared capacity budget, and
    what the mock admitted in each second of the after runs against its limit. `runs` are the
    recorded one-line results of docs/bench/p7-runs.jsonl, each with its `side`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (bars, seconds) = plt.subplots(1, 2, figsize=(11, 4.2))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    width = 0.38
    for offset, side, color in ((-width / 2, "before", "tab:red"), (width / 2, "after", "tab:green")):
        by_variant = {r["variant"]: r for r in runs if r["side"] == side}
        xs = [i + offset for i, v in enumerate(variants) if v in by_variant]
        failed = [by_variant[v]["failed"] for v in variants if v in by_variant]
        bars.bar(xs, failed, width, color=color, label=side)
        for x, n in zip(xs, failed):
            bars.annotate(f"{n:,}", (x, n), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(range(len(variants)), variants)
    bars.set_ylabel("tasks failed (of 2,000)")
    bars.set_title("Failed tasks, before and after")
    bars.legend()
    limit = None
    for r in runs:
        if r["side"] != "after" or not r.get("admitted_per_second"):
            continue
        series = r["admitted_per_second"]
        ratio = (f"{r['ratio_to_token_limit']:.3f} of the token limit"
                 if "ratio_to_token_limit" in r else f"{r['ratio_to_limit']:.3f} of the limit")
        seconds.plot(range(1, len(series) + 1), series,
                     label=f"{r['variant']}: {ratio}, {r['refused_share']:.1%} refused")
        limit = r.get("limit_per_s", 50)
    if limit:
        seconds.axhline(limit, linestyle="--", color="grey", linewidth=0.8,
                        label=f"the provider's limit: {limit:g}/s")
    seconds.set_xlabel("second of the run")
    seconds.set_ylabel("requests the mock admitted")
    seconds.set_title("After: admitted per second")
    seconds.grid(True, linewidth=0.3)
    seconds.legend(fontsize=8, loc="lower center")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle("P7: 2,000 tasks at once against a provider allowing 50 requests/s and 64 at once")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"bench-summary: wrote {out}", file=sys.stderr)


def main():
    root = Path(__file__).resolve().parent.parent
    bench = root / "target" / "bench"
    window = window_points(load(bench / "window.jsonl"))
    ceiling = ceiling_points(load(bench / "ceiling.jsonl"))
    memory = memory_points(load(bench / "memory.jsonl"))
    failover = failover_points(load(bench / "failover.jsonl"))
    summary = {
        "p1_window": window,
        "p2_ceiling": ceiling,
        "p4_memory": memory,
        "p5_failover": failover,
        "p3_profile": load(bench / "profile.jsonl"),
        "p6_front": front_points(load(bench / "front.jsonl")),
    }
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"bench-summary: wrote {bench / 'summary.json'}", file=sys.stderr)
    if window:
        plot(window, root / "docs" / "bench" / "p1-window.png")
    if memory:
        plot_memory(memory, root / "docs" / "bench" / "p4-memory.png")
    latencies = load(bench / "front-latencies.jsonl")
    if latencies:
        plot_latency_cdf(latencies, root / "docs" / "bench" / "p6-latency-cdf.png")
    capacity = load(root / "docs" / "bench" / "p7-runs.jsonl")
    if capacity:
        plot_capacity(capacity, root / "docs" / "bench" / "p7-capacity.png")


if __name__ == "__main__":
    main()
