"""The ensemble's members: how each one sees the table, drawn once at fit.

A member is a view of the preprocessed table (tabfm.preprocess.Cells), so the members disagree in ways the
pretrained model is not invariant to and their average is better than any one of them:

    columns      the kept columns in the member's own order (member 0: the original order); when a table has
                 more columns than `max_features`, each member sees a subset of that many: the columns that
                 explain most of the train targets on their own (`relevance`; CORE_SHARE of the subset) in
                 every member, and the rest of it dealt at random from the other columns, so that every column
                 is seen by some member where the members allow it; where they cannot (more columns than
                 members x max_features), from the most relevant of them, so no informative column is left out
                 by chance
    numeric      the transform of the numeric columns: "none" (the raw values; the model standardises each
                 column with its train-row mean and deviation), "robust", "quantile" or "power" (see
                 tabfm.preprocess.NUMERIC_TRANSFORMS)
    categorical  how categorical columns are shown: "embed" (the model's hashed category embedding), "ordinal"
                 (the category's code as a number) or "onehot" (one 0/1 numeric column per category, one for a
                 binary column; columns of more than ONEHOT_MAX_CATEGORIES categories, or a view that would pass
                 the model's column limit, stay "embed")

`member_cells` turns a member and the cells of some rows into the arrays the model takes; `class_codes` draws the
members' class ids (a permutation each, or with more classes than the model's head, groups of classes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tabfm.preprocess import NUMERIC_TRANSFORMS, Cells, TablePreprocessor

CATEGORICAL_VIEWS = ("embed", "ordinal", "onehot")
ONEHOT_MAX_CATEGORIES = 10
"""Most categories a column may have to be shown one-hot; wider columns keep the category embedding."""
MIN_AUTO_MEMBERS = 4
"""Members n_estimators="auto" gives a table of AUTO_MEMBER_ROWS / 4 train rows or more."""
MAX_AUTO_MEMBERS = 16
"""Most members n_estimators="auto" gives a small table (beyond this the average hardly moves)."""
CORE_SHARE = 0.5
"""Share of a member's column subset that holds the table's most relevant columns (those that explain any of the
targets alone), the same in every member. Why: dealt at random, a column that decides the target is missing from
about one member in five on a 30-column table (24 of 30 shown), whose predictions are then worse for every row
(keel_sonar's log-loss 0.466 -> 0.400 with the core); the other half of the subset keeps the members different
and every column seen. The half was chosen before measuring, not tuned."""
NARROW_MAX_FEATURES = 24
"""max_features="auto" on a table of at most the model's columns: each member sees subsets of 24 (better than every
column on 7 of the 9 tables of 25-90 columns of the 56: docs/accuracy.md)."""
WIDE_MAX_FEATURES = 64
"""max_features="auto" on a table wider than the model's columns (100 for the shipped model): each member sees
subsets of 64. There 24 shows a member a few percent of the columns, and fewer members' subsets than the columns
need: on the wide suite's five tables of 130-1,107 columns, subsets of 64 took the four classification tables'
ROC-AUC from 0.8470 to 0.8547 and log-loss from 0.4248 to 0.4184 (100 columns: 0.8524 / 0.4177, slower still),
the regression tables' R^2 0.496 -> 0.491 and 0.8814 -> 0.8812, at 1.0-1.8x the seconds. On the wide_holdout
suite, built afterwards to check it (7 tables of 150-1,502 columns): the 5 classification tables 0.9568 -> 0.9577
and 0.5114 -> 0.5107, the 2 regression tables 0.3033 -> 0.3005, at 1.5x the seconds. So the classifier takes 64
and the regressor keeps 24: its ridge base already reads every column, and the model learns what the ridge leaves
(docs/accuracy.md)."""


def auto_max_features(n_columns: int, model_columns: int, wide: int = WIDE_MAX_FEATURES) -> int:
    """The subset size max_features="auto" gives a table of n_columns columns, for a model of model_columns:
    NARROW_MAX_FEATURES up to them, `wide` past them (the classifier's WIDE_MAX_FEATURES; the regressor keeps
    NARROW_MAX_FEATURES, TabFMRegressor._wide_max_features)."""
    return NARROW_MAX_FEATURES if n_columns <= model_columns else min(wide, model_columns)


AUTO_MEMBER_ROWS = 4096
"""n_estimators="auto": members x train rows stays within this, so a small table's members cost about what 4 cost
on 1,024 train rows."""


@dataclass(frozen=True)
class Member:
    """How one ensemble member sees the table."""

    columns: np.ndarray
    """[C_m] positions of the kept columns (tabfm.preprocess.Cells), in the member's order."""
    numeric: str
    categorical: str


@dataclass
class MemberCells:
    """The arrays of one member's view of n rows (C' columns after one-hot expansion)."""

    values: np.ndarray
    """[n, C'] float64, NaN where missing (and on embedded categorical columns)."""
    codes: np.ndarray
    """[n, C'] int64 category codes of embedded categorical columns, -1 elsewhere and where missing."""
    is_cat: np.ndarray
    """[C'] bool: the column is shown through the category embedding."""
    n_cats: np.ndarray
    """[C'] int64."""


def _cycle(options: Sequence[str], allowed: Sequence[str], name: str) -> tuple[str, ...]:
    options = (options,) if isinstance(options, str) else tuple(options)
    bad = [o for o in options if o not in allowed]
    if not options or bad:
        raise ValueError(f"{name} must be a non-empty list of {list(allowed)}, got {list(options)!r}")
    return options


def _column_subsets(n_members: int, n_columns: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """n_members random subsets of `size` columns, each a random order; consecutive members deal the columns of
    one shuffled deck, so every column is used before any is used twice."""
    deck: list[int] = []
    out = []
    for _ in range(n_members):
        chosen: list[int] = []
        while len(chosen) < size:
            if not deck:
                deck = list(rng.permutation(n_columns))
            c = deck.pop()
            if c not in chosen:
                chosen.append(c)
        out.append(np.asarray(chosen, np.int64))
    return out


def auto_members(n_train: int) -> int:
    """The members n_estimators="auto" gives a table of n_train train rows: 4, and on small tables as many more
    (up to 16) as fit in the encoding a 1,024-row table's 4 members cost, since there a member is cheap and the
    average of more members is better (less spread from the draws of views, orders and subsets)."""
    return max(MIN_AUTO_MEMBERS, min(MAX_AUTO_MEMBERS, AUTO_MEMBER_ROWS // max(n_train, 1)))


def code_members(members: int, n_classes: int, n_groups: int, auto: bool) -> int:
    """The members of a table of n_classes classes given `members` (n_estimators, or what auto_members gives its
    rows), where the model's head tells n_groups apart. With more classes than that, the classes are decoded from
    class codes (class_codes), which need enough members to tell every pair of classes apart (at least
    ceil(2 ln n_classes / ln n_groups) + 1), and with `auto` get ceil(n_classes / n_groups) times as many, at most
    MAX_AUTO_MEMBERS.

    Why the scaling: such a table is decoded from class codes (class_codes), each member's head telling n_groups groups of
    classes apart, so a class gets about n_groups / n_classes of the evidence a member gives a class of a table
    the head holds whole; scaling the members by that ratio gives each class about the same evidence again. Fold 0
    of keel_letter (26 classes, 9,600 train rows) read log-loss 0.367 with 4 members, 0.310 with 8, 0.289 with 12
    (gradient boosting 0.164); 5-fold keel vowel (11 classes) 0.201 / 0.171 / 0.133 with 4 / 8 / 16; keel
    movement_libras (15 classes) 0.702 / 0.647 / 0.626 with 4 / 8 / 16, and 0.650 with 28: no more past 16."""
    if n_classes <= n_groups:
        return members
    if auto:
        members = max(members, min(members * math.ceil(n_classes / n_groups), MAX_AUTO_MEMBERS))
    return max(members, math.ceil(2 * math.log(n_classes) / math.log(n_groups)) + 1)


def members_see_every_column(n_members: int, n_columns: int, max_features: int | None) -> bool:
    """Whether subsets of max_features columns dealt to n_members members can cover every column (draw_members
    reads column relevance only where they cannot)."""
    return max_features is None or n_columns <= n_members * max_features


def draw_members(n_members: int, n_columns: int, numeric: Sequence[str], categorical: Sequence[str],
                 max_features: int | None, rng: np.random.Generator,
                 relevance: np.ndarray | None = None) -> list[Member]:
    """The ensemble's members: column orders (or subsets), and the transforms cycled in the given order.
    relevance: [n_columns] how much each column tells of the targets alone (tabfm.local_context.column_relevance),
    read only when members see subsets (more than max_features columns): the CORE_SHARE x max_features most
    relevant columns with any relevance are in every member's subset, the rest of it dealt from the other
    columns; where the members cannot see every column (more than n_members x max_features), only the
    n_members x max_features most relevant columns are used."""
    numeric = _cycle(numeric, NUMERIC_TRANSFORMS, "numeric_transforms")
    categorical = _cycle(categorical, CATEGORICAL_VIEWS, "categorical_views")
    if max_features is not None and n_columns > max_features:
        pool, core = np.arange(n_columns), np.empty(0, np.int64)
        if relevance is not None:
            relevance = np.asarray(relevance, np.float64)
            ranked = np.argsort(-relevance, kind="stable")
            if not members_see_every_column(n_members, n_columns, max_features):
                pool = np.sort(ranked[:n_members * max_features])
            core = np.sort([c for c in ranked[:int(CORE_SHARE * max_features)] if relevance[c] > 0]).astype(np.int64)
        rest = np.setdiff1d(pool, core)
        subsets = [rest[c] for c in _column_subsets(n_members, len(rest), max_features - len(core), rng)]
        columns = [rng.permutation(np.concatenate([core, c])) for c in subsets] if len(core) else subsets
    else:
        columns = [np.arange(n_columns)] + [rng.permutation(n_columns) for _ in range(n_members - 1)]
    return [Member(columns[m], numeric[m % len(numeric)], categorical[m % len(categorical)])
            for m in range(n_members)]


def _onehot_width(n_cats: int) -> int:
    return 1 if n_cats == 2 else n_cats


def _expanded_width(member: Member, is_cat: np.ndarray, n_cats: np.ndarray) -> int:
    """The columns the member would show one-hot: narrow categorical columns expanded, the others one each."""
    return sum(_onehot_width(int(n_cats[c])) if is_cat[c] and n_cats[c] <= ONEHOT_MAX_CATEGORIES else 1
               for c in member.columns)


def effective_view(member: Member, is_cat: np.ndarray, n_cats: np.ndarray, max_columns: int) -> str:
    """The categorical view a member really gets: "onehot" falls back to "embed" when the expanded columns
    would pass the model's column limit."""
    if member.categorical != "onehot":
        return member.categorical
    return "onehot" if _expanded_width(member, is_cat, n_cats) <= max_columns else "embed"


def member_width(member: Member, is_cat: np.ndarray, n_cats: np.ndarray, max_columns: int) -> int:
    """C': the number of columns the member shows the model."""
    if effective_view(member, is_cat, n_cats, max_columns) != "onehot":
        return len(member.columns)
    return _expanded_width(member, is_cat, n_cats)


def member_cells(pre: TablePreprocessor, cells: Cells, member: Member, scaled: np.ndarray | None = None) -> MemberCells:
    """The member's view of the rows of `cells`; `scaled` is pre.scale(cells, member.numeric) when the caller
    has it already (members that share a transform share it)."""
    scaled = pre.scale(cells, member.numeric) if scaled is None else scaled
    cols = member.columns
    limit = pre.max_columns if pre.max_columns is not None else len(cols) * (ONEHOT_MAX_CATEGORIES + 1)
    view = effective_view(member, cells.is_cat, cells.n_cats, limit)
    n = len(cells.values)
    values, codes, is_cat, n_cats = [], [], [], []
    for c in cols:
        code = cells.codes[:, c]
        if not cells.is_cat[c]:
            values.append(scaled[:, c])
            codes.append(np.full(n, -1, np.int64))
            is_cat.append(False)
            n_cats.append(0)
        elif view == "ordinal":
            values.append(np.where(code < 0, np.nan, code.astype(np.float64)))
            codes.append(np.full(n, -1, np.int64))
            is_cat.append(False)
            n_cats.append(0)
        elif view == "onehot" and cells.n_cats[c] <= ONEHOT_MAX_CATEGORIES:
            levels = [1] if cells.n_cats[c] == 2 else range(int(cells.n_cats[c]))
            for k in levels:
                values.append(np.where(code < 0, np.nan, (code == k).astype(np.float64)))
                codes.append(np.full(n, -1, np.int64))
                is_cat.append(False)
                n_cats.append(0)
        else:
            values.append(np.full(n, np.nan))
            codes.append(code)
            is_cat.append(True)
            n_cats.append(int(cells.n_cats[c]))
    return MemberCells(np.stack(values, 1), np.stack(codes, 1), np.asarray(is_cat, bool), np.asarray(n_cats, np.int64))


def class_codes(n_classes: int, n_groups: int, n_codes: int, rng: np.random.Generator) -> np.ndarray:
    """[n_codes, n_classes] group of each class per code: balanced random codes (a permutation when
    n_classes <= n_groups), redrawn until every pair of classes is separated by at least one code."""
    if n_classes <= n_groups:
        return np.stack([np.arange(n_classes)] + [rng.permutation(n_classes) for _ in range(n_codes - 1)])
    for _ in range(100):
        codes = np.empty((n_codes, n_classes), np.int64)
        for m in range(n_codes):
            codes[m, rng.permutation(n_classes)] = np.arange(n_classes) % n_groups
        same = (codes[:, :, None] == codes[:, None, :]).all(0)
        if same.sum() == n_classes:  # only the diagonal: all pairs separated
            return codes
    raise RuntimeError(f"could not separate {n_classes} classes with {n_codes} codes of {n_groups} groups")
