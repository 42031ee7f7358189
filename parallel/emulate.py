"""Emulated interconnects (DESIGN 3.5): make the collectives of one mesh axis as slow as a modelled link.

This machine has one flat link, so to check that the planner picks the right layout for a hierarchical
machine, a chosen axis waits until `alpha + traffic / bandwidth` has passed since each collective started (the
real collective counts toward that time). Async collectives overlapped with compute hide the wait as a real
slow link would. It is a test and benchmark tool, off by default; anything measured with it must say so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

from tabfm.parallel.mesh import TPMesh


@dataclass(frozen=True)
class Link:
    """A modelled link: per-collective latency and per-device ring bandwidth."""

    alpha: float
    """Seconds of latency per collective."""
    bandwidth: float
    """Bytes per second each device moves (ring traffic / time)."""

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.bandwidth <= 0:
            raise ValueError(f"a link needs alpha >= 0 and bandwidth > 0, got {self}")

    def seconds(self, traffic_bytes: float | Fraction) -> float:
        return self.alpha + float(traffic_bytes) / self.bandwidth

    def __call__(self, kind: str, traffic_bytes: Fraction, started: float) -> None:
        remaining = started + self.seconds(traffic_bytes) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def emulate(mesh: TPMesh, links: dict[str, Link | None]) -> TPMesh:
    """Slow the named axes ("tp0", "tp1", "dp") of `mesh` to the given links (None restores the real one)."""
    for name, link in links.items():
        mesh.axis(name).delay = link
    return mesh


def describe(mesh: TPMesh) -> str:
    """A line saying which axes are emulated, for every output made with emulation on."""
    parts = [f"{n}: alpha={a.delay.alpha:g}s bw={a.delay.bandwidth:.3g}B/s"
             for n in ("tp0", "tp1", "dp") if isinstance((a := mesh.axis(n)).delay, Link)]
    return "EMULATED LINKS ON (" + "; ".join(parts) + ")" if parts else "real links (no emulation)"
