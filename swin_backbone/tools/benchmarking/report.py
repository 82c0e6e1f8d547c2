"""The rows as they are printed and stored: medians and per-round speedups, the memory row, and
the ``--json`` file rewritten as each row finishes."""
from __future__ import annotations

import json
import statistics
from typing import Dict, List

from ..common import atomic_write


def summarize(label: str, times: Dict[str, List[float]], reference: str = "mmdet") -> dict:
    """Medians of every model, and each one's speedup over ``reference`` (median of per-round ratios);
    ``reference`` not among them (mmdet not installed): over ours."""
    reference = reference if reference in times else "ours"
    med = {k: statistics.median(v) for k, v in times.items()}
    speedups = {
        k: statistics.median(r / o for r, o in zip(times[reference], v)) for k, v in times.items() if k != reference
    }
    parts = [f"{k} {med[k] * 1e3:.1f} ms" + (f" ({speedups[k]:.2f}x)" if k in speedups else "") for k in times]
    print(f"{label}: " + ", ".join(parts) + f"  [speedup over {reference}]")
    result = {"samples": times, "median_s": med, "speedup_over_" + reference: speedups}
    peers = [k for k in times if k not in ("ours", reference)]
    if "ours" in times and peers and reference != "ours":  # ours against every other model, per round as well
        ours_over = {k: statistics.median(p / o for p, o in zip(times[k], times["ours"])) for k in peers}
        print(f"{label}: ours faster than " + ", ".join(f"{k} {r:.2f}x" for k, r in ours_over.items()))
        result["ours_speedup_over"] = ours_over
    if "ours" in times and reference in times and reference != "ours":  # the keys earlier runs and the tests read
        result.update(ours_s=med["ours"], mmdet_s=med[reference], speedup=speedups["ours"])
    return result


def memory_row(label: str, mem: Dict[str, int]) -> dict:
    """Print and return the peak-memory row: ours, and mmdet's with the ratio where it ran."""
    if "mmdet" not in mem:
        print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB")
        return {"ours_bytes": mem["ours"]}
    ratio = mem["ours"] / mem["mmdet"]
    print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB, mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {ratio:.2f}x")
    return {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"], "ratio": ratio}


class SavedResults(dict):
    """The results, rewritten to ``path`` (JSON) whenever a row is added: a run cut short (a
    time limit) keeps the rows it finished."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        atomic_write(self.path, json.dumps(self, indent=2).encode())
