"""PNG plots of a results dict (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_all(r: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plots")
        return []
    written: list[Path] = []

    def save(fig: Any, tag: str) -> None:
        path = out_dir / f"{name}-{tag}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "handoff" in r:
        rows = r["handoff"]
        labels = [f"{v['n_past']} tok" for v in rows.values()]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = range(len(labels))
        ax.bar(
            [i - 0.2 for i in x],
            [v["handoff_ttft_ms"]["median"] for v in rows.values()],
            0.4,
            label="KV hand-off (DECODE)",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [v["recompute_ttft_ms"]["median"] for v in rows.values()],
            0.4,
            label="recompute (chat)",
        )
        ax.set_xticks(list(x), labels)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title("1. Hand-off vs recompute")
        ax.legend()
        save(fig, "handoff")
    if "restore" in r:
        rows = r["restore"]
        sizes = [v["blob_bytes"] / 1e6 for v in rows.values()]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax1.plot(sizes, [v["decode_ack_ms"]["median"] for v in rows.values()], "o-", label="DECODE ack")
        ax1.plot(
            sizes, [v["inprocess_set_data_ms"]["median"] for v in rows.values()], "s-", label="in-process set_data"
        )
        ax1.set_xscale("log")
        ax1.set_yscale("log")
        ax1.set_xlabel("blob MB")
        ax1.set_ylabel("ms")
        ax1.legend()
        ax2.plot(sizes, [v["state_put_MBps"]["median"] for v in rows.values()], "o-", label="STATE_PUT")
        ax2.plot(sizes, [v["raw_loopback_MBps"]["median"] for v in rows.values()], "s-", label="raw loopback socket")
        ax2.set_xscale("log")
        ax2.set_xlabel("blob MB")
        ax2.set_ylabel("MB/s")
        ax2.legend()
        fig.suptitle("2. Restore path vs its limits")
        save(fig, "restore")
    if "concurrency" in r:
        rows = r["concurrency"]
        ks = [int(k) for k in rows]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(
            ks, [v["ours_decode"]["aggregate_tokens_per_s"] for v in rows.values()], "o-", label="hydra-trio DECODE"
        )
        ax.plot(ks, [v["ours_chat"]["aggregate_tokens_per_s"] for v in rows.values()], "s-", label="hydra-trio chat")
        for peer, label in (("llama_server", "llama-server chat"), ("llama_cpp_server", "llama_cpp.server chat")):
            if all(f"{peer}_chat" in v for v in rows.values()):
                ax.plot(ks, [v[f"{peer}_chat"]["aggregate_tokens_per_s"] for v in rows.values()], "^-", label=label)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title("5. Concurrency")
        ax.legend()
        save(fig, "concurrency")
    if "cancel" in r:
        rows = r["cancel"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(
            list(rows),
            [v["delete_ms"]["median"] for v in rows.values()],
            yerr=[[0] * len(rows), [v["delete_ms_max"] - v["delete_ms"]["median"] for v in rows.values()]],
        )
        ax.set_ylabel("DELETE latency (ms), median and max")
        ax.set_title("4. Cancellation")
        save(fig, "cancel")
    return written
