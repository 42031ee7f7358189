"""Local contexts: a table with many train rows is shown to the model as overlapping neighbourhoods of them.

Why: the shipped model was pretrained on tables of at most 256 rows (1,024 in its last legs). Given a longer
context it averages over rows far from the one it predicts and behaves like a smooth, global fit; given the
train rows nearest a test row it fits the local structure that trees find (retrieval as in LoCalPFN, Thomas et
al. 2024). One context per test row could not be cached, so each ensemble member instead draws its own anchors
(the centres of a short k-means over a distance space of the columns). A train row's home is its nearest anchor;
an anchor's context is its home rows and then the next nearest rows, `rows` in all, so about OVERLAP contexts
hold each train row. Those contexts are encoded once at fit like any other; a test row is predicted, per member,
from the context that is home to most of its ROUTE_NEIGHBOURS nearest train rows.
Members draw different anchors, so a row near the edge of one member's context is inside another's, and the
ensemble's average smooths the edges. The classifier's calibration may ask the first members to leave some train
rows (`held`) out of every context of theirs: those members then predict the held rows as they would new rows,
from caches the fit encodes anyway (tabfm.calibration).

Cost: encoding is about OVERLAP x train rows x `rows` per attention over rows instead of train rows squared, and
a test row reads `rows` keys instead of all train rows: linear in the train rows.

Distance space (LocalContexts.space): numeric columns divided by their train peak, then standardised; a
categorical column of at most ONEHOT_CATEGORIES categories one-hot, scaled so that two categories are one unit
apart, a wider one its code standardised; missing cells sit at the column's centre. Each column is then weighted
by how much of the train targets it explains on its own (column_relevance: the square root of the adjusted
correlation ratio over RELEVANCE_BINS quantile bins, or its categories), so that neighbours agree on the
columns that matter and a column of noise does not scatter them; a table where no column explains anything
alone keeps equal weights.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tabfm.preprocess import Cells

OVERLAP = 2.0
"""Contexts per member x their rows / train rows: about how many of a member's contexts hold each train row.
Accuracy is flat in it from 1.0 to 3.0 on the 56 tables, and 1.5 (11-17% less time) lost log-loss on the large and
holdout suites, so 2.0 stays (docs/accuracy.md, "How many local contexts hold each train row")."""
ROUTE_NEIGHBOURS = 16
"""A test row goes to the context that is home to most of this many of its nearest train rows."""
ANCHOR_SAMPLE = 10_000
"""Most train rows the anchors' k-means runs on (its cost grows with rows x anchors)."""
KMEANS_ITERATIONS = 10
"""Lloyd iterations of the anchors' k-means: enough to balance the cells, not to converge."""
ONEHOT_CATEGORIES = 10
"""Categorical columns of at most this many categories are one-hot in the distance space."""
RELEVANCE_BINS = 16
"""Quantile bins of a numeric column in column_relevance (a missing cell is a bin of its own)."""
SPACE_LIMIT = 1e6
"""Largest coordinate in the distance space, in column deviations (far past any train row; its square and sums of
squares stay finite in float32)."""
_DISTANCE_CELLS = 1 << 24
"""Most entries of one block of pairwise distances (bounds the memory of a nearest-row search)."""


def _space_columns(cells: Cells) -> list[tuple[int, int]]:
    """(column, one-hot width or 0) of each column of the distance space."""
    return [(c, int(cells.n_cats[c]) if cells.is_cat[c] and cells.n_cats[c] <= ONEHOT_CATEGORIES else 0)
            for c in range(cells.values.shape[1])]


def _raw_space(cells: Cells) -> np.ndarray:
    """[n, D] float64 before centring: numeric values, category codes (NaN where missing), one-hot blocks."""
    blocks = []
    for c, width in _space_columns(cells):
        if width:
            code = cells.codes[:, c]
            blocks.append((code[:, None] == np.arange(width)[None]).astype(np.float64) / math.sqrt(2))
        elif cells.is_cat[c]:
            code = cells.codes[:, c].astype(np.float64)
            blocks.append(np.where(code < 0, np.nan, code)[:, None])
        else:
            blocks.append(cells.values[:, c, None])
    return np.concatenate(blocks, 1)


def _column_groups(cells: Cells, c: int) -> np.ndarray:
    """[n] int64 group of each row in column c: its category (missing last) or its quantile bin (missing last)."""
    if cells.is_cat[c]:
        code = cells.codes[:, c]
        return np.where(code < 0, int(cells.n_cats[c]), code).astype(np.int64)
    x = cells.values[:, c]
    seen = ~np.isnan(x)
    if not seen.any():
        return np.zeros(len(x), np.int64)
    edges = np.unique(np.quantile(x[seen], np.linspace(0, 1, RELEVANCE_BINS + 1)[1:-1]))
    return np.where(seen, np.searchsorted(edges, np.nan_to_num(x), side="right"), len(edges) + 1).astype(np.int64)


def column_relevance(cells: Cells, targets: np.ndarray) -> np.ndarray:
    """[C] in 0..1 per column: the square root of the adjusted share of the targets' variance that the column's
    groups (_column_groups) explain, 1 - (1 - eta^2) (n - 1) / (n - groups), at least 0. targets [n, T]: one-hot
    classes or standardised regression targets."""
    n = len(targets)
    total = ((targets - targets.mean(0)) ** 2).sum()
    out = np.zeros(cells.values.shape[1])
    if total <= 0 or n < 3:
        return out
    for c in range(len(out)):
        groups = _column_groups(cells, c)
        _, groups = np.unique(groups, return_inverse=True)
        count = np.bincount(groups)
        if len(count) < 2 or len(count) >= n - 1:
            continue
        sums = np.stack([np.bincount(groups, weights=t, minlength=len(count)) for t in targets.T], 1)
        between = ((sums / count[:, None] - targets.mean(0)) ** 2 * count[:, None]).sum()
        adjusted = 1 - (1 - between / total) * (n - 1) / (n - len(count))
        out[c] = math.sqrt(max(adjusted, 0.0))
    return out


def _squared_distances(queries: torch.Tensor, points: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """[q, n] squared distances of each query to each point; norms: points.square().sum(1), computed once by
    callers that go through the queries in blocks."""
    return (queries.square().sum(1, keepdim=True) + norms[None] - 2 * queries @ points.T).clamp_min(0)


def _nearest(queries: torch.Tensor, points: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared distances, indices) [q, k] of the k points nearest each query, nearest first."""
    out_d, out_i = [], []
    step = max(1, _DISTANCE_CELLS // max(len(points), 1))
    norms = points.square().sum(1)
    for start in range(0, len(queries), step):
        d = _squared_distances(queries[start:start + step], points, norms)
        dist, idx = torch.topk(d, k, dim=1, largest=False, sorted=True)
        out_d.append(dist)
        out_i.append(idx)
    return torch.cat(out_d), torch.cat(out_i)


@dataclass
class LocalContexts:
    """Each member's local contexts over the train rows, and how rows are routed to them (module docstring)."""

    peak: np.ndarray
    """[D] largest train magnitude of each distance-space column (values are divided by it first)."""
    weight: np.ndarray
    """[D] weight of each distance-space column (its table column's relevance, relative to the largest)."""
    center: np.ndarray
    """[D] train mean of each column after the peak division."""
    scale: np.ndarray
    """[D] train deviation of each column after the peak division (1 where constant)."""
    points: np.ndarray
    """[n, D] float32: the train rows in the distance space."""
    rows: np.ndarray
    """[U, k] int64: the train rows of each context, sorted (U = all members' contexts)."""
    members: np.ndarray
    """[U] int64: the member each context belongs to (a member's contexts are consecutive)."""
    home: np.ndarray
    """[M, n] int64: per member, the context whose anchor is nearest each train row."""

    @classmethod
    def fit(cls, cells: Cells, targets: np.ndarray, n_members: int, rows: int,
            rng: np.random.Generator, relevance: np.ndarray | None = None,
            device: torch.device | str = "cpu", held: np.ndarray | None = None,
            held_members: int = 0, check_counts: Callable[[list[int]], None] | None = None) -> LocalContexts:
        """Contexts of `rows` train rows for each of n_members members, from the train rows `cells` (more than
        `rows` of them) and their targets [n, T]; relevance: column_relevance(cells, targets) when the caller has
        it already (computed here otherwise). The first `held_members` members draw their anchors from, and fill
        their contexts with, only the rows not in `held` (more than `rows` of them); every row still has a home
        context in each member, which is what routing reads. The distances and the anchors' k-means run on
        `device` (the estimator's): a 50,000-row fit on a GPU took no less time in bf16 than in fp32, so it
        waited on its CPU. check_counts: called with each member's number of contexts once every member's anchors
        are drawn, before the nearest-row searches that fill the contexts (the cost of a fit at a million rows):
        where it raises, nothing else runs (the estimators' memory check, tabfm.cache_memory)."""
        raw = _raw_space(cells)
        relevance = column_relevance(cells, targets) if relevance is None else relevance
        relevance = relevance / relevance.max() if relevance.max() > 0 else np.ones_like(relevance)
        widths = [max(width, 1) for _, width in _space_columns(cells)]
        weight = np.repeat(relevance, widths)
        peak = np.nanmax(np.abs(raw), axis=0, initial=0.0)
        peak = np.where(np.isfinite(peak) & (peak > 0), peak, 1.0)
        unit = raw / peak
        with warnings.catch_warnings(), np.errstate(invalid="ignore"):  # a column with no value: centre 0, scale 1
            warnings.simplefilter("ignore", RuntimeWarning)
            center = np.nan_to_num(np.nanmean(unit, 0), nan=0.0) if len(unit) else np.zeros(unit.shape[1])
            spread = np.nan_to_num(np.nanstd(unit, 0), nan=0.0)
        scale = np.where(spread > 0, spread, 1.0)
        state = cls(peak, weight, center, scale, np.empty((0, unit.shape[1]), np.float32),
                    np.empty((0, rows), np.int64), np.empty(0, np.int64), np.empty((n_members, 0), np.int64))
        state.points = state.space(cells)
        points = torch.from_numpy(state.points).to(device)
        n = len(points)
        blocked = torch.zeros(n, dtype=torch.bool, device=points.device)
        if held is not None and held_members:
            blocked[torch.from_numpy(np.asarray(held, np.int64)).to(points.device)] = True
            if n - int(blocked.sum()) <= rows:
                raise ValueError(f"{n - int(blocked.sum())} rows are left once the held rows are out: local "
                                 f"contexts of {rows} rows need more")
        leaves_out = [m < held_members and bool(blocked.any()) for m in range(n_members)]
        anchors = [_anchors(points[~blocked] if out else points, rows, rng) for out in leaves_out]
        if check_counts is not None:
            check_counts([len(a) for a in anchors])
        all_rows, all_members, homes = [], [], []
        for m in range(n_members):
            member_rows, home = _contexts(points, anchors[m], rows, offset=sum(len(r) for r in all_rows),
                                          blocked=blocked if leaves_out[m] else None)
            all_rows.append(member_rows)
            all_members.append(np.full(len(member_rows), m, np.int64))
            homes.append(home)
        state.rows = np.concatenate(all_rows)
        state.members = np.concatenate(all_members)
        state.home = np.stack(homes) if homes else np.empty((0, n), np.int64)
        return state

    def space(self, cells: Cells) -> np.ndarray:
        """[n, D] float32: rows in the distance space (missing cells at the centre, 0). A value beyond SPACE_LIMIT
        deviations (one near float64's limit overflows) sits at the limit, so it is routed with the train rows at
        that edge of its column."""
        with np.errstate(over="ignore", invalid="ignore"):
            z = (_raw_space(cells) / self.peak - self.center) / self.scale
        z = np.clip(np.nan_to_num(z, nan=0.0, posinf=SPACE_LIMIT, neginf=-SPACE_LIMIT), -SPACE_LIMIT, SPACE_LIMIT)
        return (z * self.weight).astype(np.float32)

    def route(self, cells: Cells, points: torch.Tensor | None = None) -> np.ndarray:
        """[M, n] the context (an index into `rows`) each member predicts each row of `cells` from: the first of
        `routes`."""
        return self.routes(cells, points)[0]

    def routes(self, cells: Cells, points: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first [M, n], second [M, n], share [M, n]): per member and row of `cells`, the context home to most of
        its ROUTE_NEIGHBOURS nearest train rows, the context home to the next most, and the second's share of
        the two's votes (0 where one context is home to all of them; second is then first). A row near the edge
        of its context is predicted from both, weighted by their votes (the estimators' second-context mixture).
        points: this object's `points` as a tensor on the device to search on, where the caller keeps one across
        calls (the estimator does, per predict call); None: searched on the CPU."""
        points = torch.from_numpy(self.points) if points is None else points
        k = min(ROUTE_NEIGHBOURS, len(points))
        _, near = _nearest(torch.from_numpy(self.space(cells)).to(points.device), points, k)
        near = near.cpu().numpy()                                               # [n, k], nearest first
        weight = 1.0 + 1e-3 * (k - np.arange(k))                               # ties go to the nearer rows' home
        n, rows = len(near), np.arange(len(near))
        first, second = np.empty((len(self.home), n), np.int64), np.empty((len(self.home), n), np.int64)
        share = np.zeros((len(self.home), n))
        for m, home in enumerate(self.home):
            start = int(np.flatnonzero(self.members == m)[0])
            votes = np.zeros((n, int((self.members == m).sum())))
            np.add.at(votes, (rows[:, None], home[near] - start), weight[None])  # this member's contexts
            best = votes.argmax(1)                                              # ties: the lower index
            first[m] = start + best
            if votes.shape[1] < 2:
                second[m] = first[m]
                continue
            top = votes[rows, best]
            votes[rows, best] = -1.0                                            # the runner-up is the next argmax
            runner = votes.argmax(1)
            next_ = votes[rows, runner]
            second[m] = np.where(next_ > 0, start + runner, first[m])
            share[m] = next_ / (top + next_)
        return first, second, share


def _anchors(points: torch.Tensor, rows: int, rng: np.random.Generator) -> torch.Tensor:
    """[A, D] anchors, A = ceil(OVERLAP x n / rows): the centres of a short k-means over (a sample of) the train
    rows, so that each anchor's cell of nearest rows holds about n / A of them."""
    n = len(points)
    pool = points
    if n > ANCHOR_SAMPLE:
        pool = points[torch.from_numpy(np.sort(rng.choice(n, ANCHOR_SAMPLE, replace=False))).to(points.device)]
    distinct = len(torch.unique(pool, dim=0))
    return _kmeans(pool, min(math.ceil(OVERLAP * n / rows), distinct), rng)  # no two anchors on one point


def _kmeans(points: torch.Tensor, count: int, rng: np.random.Generator) -> torch.Tensor:
    """[count, D] centres of KMEANS_ITERATIONS Lloyd iterations from a k-means++ start, on points' device.

    Hand-written rather than sklearn's KMeans, which runs on the CPU only and whose greedy k-means++ scores
    2 + log(count) candidates per centre (391 centres per member on a 50,000-row table, twice per fit). The
    draws come from `rng` (numpy), so the anchors do not depend on the device's generator. Needs count distinct
    points (the caller's), so every draw has a point at a positive distance."""
    norms = points.square().sum(1)

    def to(i: int) -> torch.Tensor:
        return (norms + norms[i] - 2 * points @ points[i]).clamp_min_(0)

    chosen = [int(rng.integers(len(points)))]
    nearest = to(chosen[0])
    for _ in range(1, count):
        cumulative = np.cumsum(nearest.cpu().numpy(), dtype=np.float64)  # on the CPU: MPS has no float64
        if cumulative[-1] <= 0:  # only duplicates of the chosen left (float rounding): any unchosen point
            chosen.append(int(rng.choice(np.setdiff1d(np.arange(len(points)), chosen))))
        else:
            chosen.append(min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")),
                              len(points) - 1))
        torch.minimum(nearest, to(chosen[-1]), out=nearest)
    centres = points[chosen].clone()
    for _ in range(KMEANS_ITERATIONS):
        label = (centres.square().sum(1)[None] - 2 * points @ centres.T).argmin(1)  # + norms: same argmin
        sums = torch.zeros_like(centres).index_add_(0, label, points)
        counts = torch.bincount(label, minlength=count).to(points.dtype)[:, None]
        centres = torch.where(counts > 0, sums / counts.clamp_min(1), centres)      # an empty cell keeps its centre
    return centres


def _contexts(points: torch.Tensor, anchors: torch.Tensor, rows: int, offset: int,
              blocked: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([A, rows] sorted train rows of each anchor's context, [n] home context of each train row + offset).

    A row's home is its nearest anchor; an anchor's context is its home rows (the nearest `rows` of them if it has
    more), then the nearest other rows up to `rows`; rows `blocked` [n] (bool) are in no context, though they
    have a home."""
    n = len(points)
    _, nearest_anchor = _nearest(points, anchors, 1)
    home = nearest_anchor[:, 0]                                                 # [n]
    norms = points.square().sum(1)
    far = float(norms.max()) * 4 + 1.0                                          # farther than any real distance
    out = []
    step = max(1, _DISTANCE_CELLS // max(n, 1))
    for start in range(0, len(anchors), step):
        a = anchors[start:start + step]
        d = _squared_distances(a, points, norms)
        own = torch.arange(start, start + len(a), device=points.device)
        d = d + far * (home[None] != own[:, None])                              # home rows first
        if blocked is not None:
            d = d.masked_fill(blocked[None], math.inf)
        out.append(torch.topk(d, rows, dim=1, largest=False).indices)
    return np.sort(torch.cat(out).cpu().numpy(), 1).astype(np.int64), home.cpu().numpy().astype(np.int64) + offset


def padded_chunks(counts: list[int], slack: float = 1.5) -> list[np.ndarray]:
    """Tables (positions in `counts`, the test rows routed to each) grouped for one padded forward each: largest
    first, a group grows while its padded rows (size x its largest count) stay within `slack` x its real rows.
    Tables with no rows are left out."""
    order = [int(t) for t in np.argsort(-np.asarray(counts), kind="stable") if counts[t] > 0]
    chunks: list[list[int]] = []
    for t in order:
        if chunks:
            chunk = chunks[-1]
            if (len(chunk) + 1) * counts[chunk[0]] <= slack * (sum(counts[c] for c in chunk) + counts[t]):
                chunk.append(t)
                continue
        chunks.append([t])
    return [np.asarray(c, np.int64) for c in chunks]
