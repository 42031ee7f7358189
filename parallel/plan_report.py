"""The plan as a person reads it (the planner's last part): the ranked table of `tabfm plan` and its bar chart."""

from __future__ import annotations

from pathlib import Path

from tabfm.parallel.plan_cost import Candidate


def format_bytes(b: float) -> str:
    """Bytes with a decimal unit and 3 significant digits (1.5GB, 12MB, 300B)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g}{unit}"
    return f"{b:.0f}B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g}"


def table(candidates: list[Candidate], top: int | None = None) -> str:
    """The ranked table: valid candidates (best first), then rejected layouts with why."""
    head = (f"{'rank':>4}  {'layout':>6}  {'sp':>3}  {'k':>2}  {'step ms':>9}  {'compute':>8}  {'comm tp0':>9}  "
            f"{'comm tp1':>9}  {'vol tp0':>8}  {'vol tp1':>8}  {'mem/dev':>8}")
    lines = [head, "-" * len(head)]
    valid = [c for c in candidates if c.valid]
    for c in valid[:top] if top else valid:
        lines.append(f"{c.rank:>4}  {c.layout:>6}  {'on' if c.sequence_parallel else 'off':>3}  {c.chunks:>2}  "
                     f"{_fmt_s(c.step_seconds):>9}  {_fmt_s(c.compute_seconds):>8}  "
                     f"{_fmt_s(c.comm_seconds['tp0']):>9}  {_fmt_s(c.comm_seconds['tp1']):>9}  "
                     f"{format_bytes(c.volume['tp0']):>8}  {format_bytes(c.volume['tp1']):>8}  "
                     f"{format_bytes(c.memory.total):>8}")
    if top and len(valid) > top:
        lines.append(f"  ... {len(valid) - top} more valid candidates")
    rejected: dict[str, list[str]] = {}
    for c in candidates:
        if not c.valid:
            rejected.setdefault(f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}", [])
            for p in c.problems:
                if p not in rejected[f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}"]:
                    rejected[f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}"].append(p)
    if rejected:
        lines.append("rejected:")
        lines += [f"  {k}: {'; '.join(v[:4])}{' ...' if len(v) > 4 else ''}" for k, v in rejected.items()]
    lines.append("comm = exposed communication ms per step; vol = ring traffic per device per step; "
                 "mem/dev = weights + grads + optimizer + saved activations")
    return "\n".join(lines)


def draw(candidates: list[Candidate], path: str | Path, title: str = "") -> Path:
    """A bar chart: predicted step time (compute + exposed communication per axis) of the best chunk count of each
    (layout, sequence parallel), rejected layouts named with their first reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[tuple, Candidate] = {}
    for c in candidates:
        if c.valid and (c.d0, c.d1, c.sequence_parallel) not in best:
            best[(c.d0, c.d1, c.sequence_parallel)] = c
    rows = sorted(best.values(), key=lambda c: c.step_seconds)
    rejected = {}
    for c in candidates:
        if not c.valid and (c.d0, c.d1, c.sequence_parallel) not in best:
            rejected.setdefault(f"{c.layout}{' sp' if c.sequence_parallel else ''}", c.problems[0])
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.45 * (len(rows) + len(rejected))))
    labels = [c.label for c in rows]
    y = list(range(len(rows)))
    comp = [c.compute_seconds * 1e3 for c in rows]
    c0 = [c.comm_seconds["tp0"] * 1e3 for c in rows]
    c1 = [c.comm_seconds["tp1"] * 1e3 for c in rows]
    ax.barh(y, comp, color="#4c72b0", label="compute")
    ax.barh(y, c0, left=comp, color="#dd8452", label="exposed comm, axis 0")
    ax.barh(y, c1, left=[a + b for a, b in zip(comp, c0)], color="#55a868", label="exposed comm, axis 1")
    for k, (name, why) in enumerate(rejected.items()):
        labels.append(f"{name} (rejected)")
        ax.text(0, len(rows) + k, f" {why[:90]}", va="center", fontsize=7, color="#a33")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time, ms")
    ax.set_title(title or "ATP plan", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (len(labels) + 1)), ncol=3,
              frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
