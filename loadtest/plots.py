"""PNG plots of a replay (matplotlib, Agg backend): latency over time and queue depth over time."""

from __future__ import annotations

from pathlib import Path

from loadtest.replay import StatusSample
from loadtest.summary import RequestResult

TIER_COLORS = {"vip": "tab:red", "standard": "tab:blue", "free": "tab:green", "batch": "tab:gray"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(results: list[RequestResult], path: str | Path, slo_ttft_s_by_tier: dict[str, float],
                 title: str = "") -> Path:
    """Plot TTFT and e2e latency (s) of OK requests against their send time, per tier; rejections as marks at 0.

    Args:
        results: the replay's requests.
        path: PNG to write.
        slo_ttft_s_by_tier: drawn as dashed horizontal lines on the TTFT panel.
        title: figure title.

    Returns:
        The path written.
    """
    plt = _pyplot()
    fig, (ax_ttft, ax_e2e) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    tiers = sorted({r.tier for r in results})
    for tier in tiers:
        color = TIER_COLORS.get(tier)
        ok = [r for r in results if r.tier == tier and r.outcome == "ok" and r.ttft_s is not None]
        ax_ttft.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=6, color=color, label=f"{tier} ok")
        ax_e2e.scatter([r.sent_s for r in ok], [r.e2e_s for r in ok], s=6, color=color, label=tier)
        failed = [r for r in results if r.tier == tier and r.outcome != "ok"]
        if failed:
            ax_ttft.scatter([r.sent_s if r.sent_s is not None else r.arrival_s for r in failed], [0.0] * len(failed),
                            marker="x", s=14, color=color, label=f"{tier} rejected/failed")
        if tier in slo_ttft_s_by_tier:
            ax_ttft.axhline(slo_ttft_s_by_tier[tier], color=color, linestyle="--", linewidth=0.8)
    ax_ttft.set_ylabel("TTFT (s)")
    ax_e2e.set_ylabel("end-to-end (s)")
    ax_e2e.set_xlabel("send time (s after start)")
    ax_ttft.legend(fontsize=7, ncol=3)
    ax_ttft.set_title(title or "latency over time")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_queue_depth(samples: list[StatusSample], path: str | Path, title: str = "") -> Path:
    """Plot admission queue depth per tier and the workers' running / waiting sequences over time.

    Returns:
        The path written.
    """
    plt = _pyplot()
    fig, (ax_queue, ax_worker) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    times = [s.t_s for s in samples]
    tiers = sorted({name for s in samples for name in s.queue_depth_by_tier})
    for tier in tiers:
        ax_queue.plot(times, [s.queue_depth_by_tier.get(tier, 0) for s in samples], label=tier,
                      color=TIER_COLORS.get(tier))
    ax_queue.plot(times, [s.active_requests or 0 for s in samples], label="active requests (gateway)",
                  color="black", linewidth=0.8)
    ax_queue.set_ylabel("requests")
    ax_queue.legend(fontsize=7)
    ax_queue.set_title(title or "queue depth over time")
    workers = sorted({name for s in samples for name in s.running_by_worker})
    for worker in workers:
        ax_worker.plot(times, [s.running_by_worker.get(worker, 0) for s in samples], label=f"{worker} running")
        ax_worker.plot(times, [s.waiting_by_worker.get(worker, 0) for s in samples], linestyle="--",
                       label=f"{worker} waiting")
    ax_worker.set_ylabel("sequences in worker")
    ax_worker.set_xlabel("time (s after start)")
    ax_worker.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_replay(results: list[RequestResult], samples: list[StatusSample], plot_dir: str | Path,
                slo_ttft_s_by_tier: dict[str, float], prefix: str = "replay", title: str = "") -> list[Path]:
    """Write ``<prefix>_latency.png`` and ``<prefix>_queue.png`` under ``plot_dir``; return their paths."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency(results, plot_dir / f"{prefix}_latency.png", slo_ttft_s_by_tier, title),
        plot_queue_depth(samples, plot_dir / f"{prefix}_queue.png", title),
    ]
