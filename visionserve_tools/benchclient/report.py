"""Figures from raw records: percentiles, miss ratio, error counts, batch sizes, CPU, plots."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections import Counter

import numpy as np

from . import wire

PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9))


def latency_summary(ms: np.ndarray) -> dict[str, float | None]:
    out: dict[str, float | None]
    if ms.size == 0:
        out = {k: None for k, _ in PERCENTILES}
        return out | {"max": None, "mean": None, "min": None}
    out = {k: round(float(np.percentile(ms, q)), 4) for k, q in PERCENTILES}
    out |= {"max": round(float(ms.max()), 4), "mean": round(float(ms.mean()), 4),
            "min": round(float(ms.min()), 4)}
    return out


def summarize(res, *, warmup_s: float, window_s: float, budget_ms: float | None,
              bare_answers: list[dict] | None = None) -> dict:
    """One run's figures over the measured window (frames scheduled after the warm-up)."""
    keep = res.sched_ns >= int(warmup_s * 1e9)
    outcome = res.outcome[keep]
    lat_ns = res.latency_ns[keep]
    answered = lat_ns >= 0
    ok = outcome == wire.OK
    lat_ms = lat_ns[answered] / 1e6
    ok_ms = lat_ns[ok] / 1e6
    counts = Counter(wire.OUTCOMES[int(o)] for o in outcome)
    sent = int(keep.sum())
    over_budget = int((ok_ms > budget_ms).sum()) if budget_ms else 0
    server_miss = int(sum(counts.get(wire.OUTCOMES[o], 0) for o in wire.MISS_OUTCOMES))
    misses = server_miss + over_budget
    errors = {k: v for k, v in counts.items() if k != "ok"}
    if over_budget:
        errors["over_budget_at_client"] = over_budget
    bs = res.batch[keep][ok]
    per_frame = {str(k): int(v) for k, v in sorted(Counter(int(b) for b in bs if b > 0).items())}
    lag_ms = res.lag_ns[keep] / 1e6
    out = {
        "sent": sent,
        "answered_ok": int(ok.sum()),
        "throughput_fps": round(int(ok.sum()) / window_s, 3) if window_s > 0 else None,
        "offered_fps": round(sent / window_s, 3) if window_s > 0 else None,
        "latency_ms": latency_summary(ok_ms),
        "latency_all_answers_ms": latency_summary(lat_ms),
        "deadline_misses": misses,
        "miss_ratio": round(misses / sent, 6) if sent else None,
        "errors": errors,
        "error_examples": res.details,
        "batch_size_per_frame": {"distribution": per_frame,
                                 "mean": round(float(bs[bs > 0].mean()), 3) if (bs > 0).any()
                                 else None},
        "send_lag_ms": {"p50": round(float(np.percentile(lag_ms, 50)), 4) if lag_ms.size else None,
                        "p99": round(float(np.percentile(lag_ms, 99)), 4) if lag_ms.size else None,
                        "max": round(float(lag_ms.max()), 4) if lag_ms.size else None},
        "generator_cpu_s": round(res.cpu_s, 3),
    }
    if bare_answers:
        out["answers_vs_bare"] = compare_answers(res, keep & (res.outcome == wire.OK), bare_answers)
    return out


def overload_summary(res, *, warmup_s: float, window_s: float, deadline_ms: float) -> dict:
    """What overload did to one run's frames: goodput (answers within ``deadline_ms`` at the
    client, per second), and how the rest ended: refused (with and without Retry-After, and how
    fast the refusal came back), late, or otherwise."""
    keep = res.sched_ns >= int(warmup_s * 1e9)
    outcome = res.outcome[keep]
    lat_ns = res.latency_ns[keep]
    good = (outcome == wire.OK) & (lat_ns >= 0) & (lat_ns <= int(deadline_ms * 1e6))
    refused = outcome == wire.REJECTED
    bare = outcome == wire.REJECTED_BARE
    late = np.isin(outcome, wire.MISS_OUTCOMES) | ((outcome == wire.OK) & ~good)
    sent = int(keep.sum())
    n_good, n_refused, n_bare, n_late = (int(x.sum()) for x in (good, refused, bare, late))
    refused_ms = lat_ns[(refused | bare) & (lat_ns >= 0)] / 1e6
    return {
        "sent": sent,
        "offered_fps": round(sent / window_s, 3),
        "goodput_fps": round(n_good / window_s, 3),
        "in_time": n_good,
        "refused_with_retry_after": n_refused,
        "refused_without_retry_after": n_bare,
        "late": n_late,
        "other": sent - n_good - n_refused - n_bare - n_late,
        "refused_share": round((n_refused + n_bare) / sent, 4) if sent else None,
        "refusal_latency_ms": latency_summary(refused_ms),
    }


def compare_answers(res, mask: np.ndarray, bare_answers: list[dict]) -> dict:
    """Served verdict/label per frame against the in-process single-frame answer."""
    idx = np.nonzero(mask)[0]
    mism_v = mism_l = 0
    max_dscore = 0.0
    inv = {v: k for k, v in wire.VERDICTS.items()}
    for i in idx:
        b = bare_answers[int(res.frame[i])]
        if inv.get(int(res.verdict[i])) != b["verdict"]:
            mism_v += 1
        if res.labels[i] and res.labels[i] != b["label"]:
            mism_l += 1
        s = res.score[i]
        if not np.isnan(s):
            max_dscore = max(max_dscore, abs(float(s) - b["score"]))
    return {"checked": int(idx.size), "verdict_mismatches": mism_v, "label_mismatches": mism_l,
            "max_abs_score_diff": round(max_dscore, 6)}


# --- /metrics --------------------------------------------------------------------------------

_BUCKET_RE = re.compile(r'^visionserve_batch_size_bucket\{([^}]*)\}\s+([0-9.eE+-]+)')
_SUMCOUNT_RE = re.compile(r'^visionserve_batch_size_(sum|count)\{([^}]*)\}\s+([0-9.eE+-]+)')


def scrape_batch_hist(url: str, model: str, timeout: float = 5.0) -> dict | None:
    """Cumulative ``visionserve_batch_size`` buckets for ``model`` (None if not a visionserve)."""
    text = None
    for attempt in range(3):  # a saturated server on a small box may answer /metrics late
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/metrics",
                                        timeout=timeout * (attempt + 1)) as r:
                text = r.read().decode("utf-8", "replace")
            break
        except urllib.error.HTTPError:
            return None
        except OSError:
            continue
    if text is None:
        return None
    buckets: dict[str, float] = {}
    sc: dict[str, float] = {}
    want = f'model="{model}"'
    for line in text.splitlines():
        m = _BUCKET_RE.match(line)
        if m and want in m.group(1):
            found = re.search(r'le="([^"]+)"', m.group(1))
            assert found is not None, line  # a histogram bucket always has its le label
            le = found.group(1)
            buckets[le] = float(m.group(2))
            continue
        m = _SUMCOUNT_RE.match(line)
        if m and want in m.group(2):
            sc[m.group(1)] = float(m.group(3))
    if not buckets:
        return None
    return {"buckets": buckets, "sum": sc.get("sum", 0.0), "count": sc.get("count", 0.0)}


def scrape_oip_batch_stats(url: str, model: str, timeout: float = 5.0) -> dict | None:
    """Executions per batch size from the OIP statistics extension (Triton and visionserve)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/models/{model}/stats",
                                    timeout=timeout) as r:
            data = json.loads(r.read())
        stats = data["model_stats"][0]
        return {int(b["batch_size"]): int(b["compute_infer"]["count"])
                for b in stats.get("batch_stats", [])}
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def oip_batch_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    dist = {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0) > 0}
    batches = sum(dist.values())
    frames = sum(k * v for k, v in dist.items())
    return {"source": "OIP /v2/models/{m}/stats batch_stats", "batches": batches, "frames": frames,
            "distribution": {str(k): v for k, v in dist.items()},
            "mean_batch_size": round(frames / batches, 3) if batches else None}


def batch_hist_delta(before: dict | None, after: dict | None) -> dict | None:
    """Batches per size bucket executed between two scrapes (non-cumulative), and the mean."""
    if not before or not after:
        return None

    def key(le: str) -> float:
        return float("inf") if le == "+Inf" else float(le)

    les = sorted(after["buckets"], key=key)
    dist, prev_le, prev = {}, 0.0, 0.0
    for le in les:
        cum = after["buckets"][le] - before["buckets"].get(le, 0.0)
        n = round(cum - prev)
        lo, hi = prev_le, key(le)
        if hi == float("inf"):
            name = f">{int(lo)}"
        else:
            name = f"{int(hi)}" if hi - lo <= 1 else f"{int(lo) + 1}-{int(hi)}"
        if n:
            dist[name] = n
        prev, prev_le = cum, hi
    count = after["count"] - before["count"]
    total = after["sum"] - before["sum"]
    return {"source": "/metrics visionserve_batch_size", "batches": round(count),
            "frames": round(total), "distribution": dist,
            "mean_batch_size": round(total / count, 3) if count else None}


# --- CPU of a process tree -------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and all its descendants now alive (Linux /proc)."""
    try:
        children: dict[int, list[int]] = {}
        stats: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    raw = f.read().decode("latin-1")
            except OSError:
                continue
            rest = raw[raw.rfind(")") + 2:].split()
            p = int(name)
            children.setdefault(int(rest[1]), []).append(p)
            stats[p] = (int(rest[11]), int(rest[12]))
    except OSError:
        return None
    if pid not in stats:
        return None
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        u, s = stats.get(p, (0, 0))
        total += u + s
        todo.extend(children.get(p, []))
    return total / _TICK


def loop_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``'s main thread (Linux /proc): in visionserve's serving
    process, the event loop, which every frame passes through (the front ends' messages, the
    batcher, the answers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            raw = f.read().decode("latin-1")
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _TICK


# --- plots -----------------------------------------------------------------------------------


def plot_cdf(runs: list[tuple[str, np.ndarray]], path: str, budget_ms: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ms in runs:
        if ms.size == 0:
            continue
        xs = np.sort(ms)
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.plot(xs, ys, label=name, lw=1.4)
    if budget_ms:
        ax.axvline(budget_ms, color="red", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of frames answered")
    ax.set_title("Latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(steps: list[dict], path: str, budget_ms: float | None, label: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [s["throughput_fps"] for s in steps]
    ys = [s["latency_ms"]["p99"] or float("nan") for s in steps]
    ax.plot(xs, ys, "o-", label=label or "p99")
    for s, x, y in zip(steps, xs, ys):
        ax.annotate(f"{s['offered_rate']:g}/s", (x, y), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    if budget_ms:
        ax.axhline(budget_ms, color="red", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("answered frames/s")
    ax.set_ylabel("p99 latency (ms, log scale)")
    ax.set_title("Throughput vs p99 across the sweep (labels: offered rate)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
