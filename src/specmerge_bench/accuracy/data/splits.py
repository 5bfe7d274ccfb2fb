"""Balanced, group-disjoint train / val / test splits of one task (rules in the package docstring)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from specmerge_bench.accuracy.data.fetch import AccuracyDataError


@dataclass(frozen=True)
class SplitSizes:
    """Split sizes summed over classes; a task with n classes gets ``size // n`` texts per class.

    ``max_train`` caps the training split; a task left with fewer than ``min_train`` training texts is an error.
    """

    test: int = 1200
    val: int = 600
    max_train: int = 10_000
    min_train: int = 2_400


@dataclass(frozen=True)
class TaskSplits:
    """One task: class names (label id = position) and its train / val / test lists of (text, label id)."""

    labels: tuple[str, ...]
    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    test: list[tuple[str, int]]


def balanced_splits(
    candidates: Iterable[tuple[str, str, str]], n_classes: int, sizes: SplitSizes, rng: random.Random
) -> TaskSplits:
    """Balanced, group-disjoint train / val / test from (text, class, group) candidates (module docstring rules)."""
    label_of: dict[str, str] = {}
    group_of: dict[str, str] = {}
    conflicting: set[str] = set()
    for text, name, group in candidates:
        if label_of.setdefault(text, name) != name:
            conflicting.add(text)
        group_of[text] = min(group, group_of.get(text, group))
    members: dict[str, dict[str, list[str]]] = {}  # group -> class -> texts
    for text, name in label_of.items():
        if text not in conflicting:
            members.setdefault(group_of[text], {}).setdefault(name, []).append(text)

    n_groups = Counter(name for by_class in members.values() for name in by_class)
    ranked = sorted(n_groups, key=lambda name: (-n_groups[name], name))
    if len(ranked) < n_classes:
        raise AccuracyDataError(f"{n_classes} classes wanted, the data has {len(ranked)}: {ranked}")
    labels = tuple(sorted(ranked[:n_classes]))
    n_test, n_val, cap = sizes.test // n_classes, sizes.val // n_classes, sizes.max_train // n_classes

    groups = sorted(group for group, by_class in members.items() if not by_class.keys().isdisjoint(labels))
    rng.shuffle(groups)
    test: dict[str, list[str]] = {name: [] for name in labels}
    val: dict[str, list[str]] = {name: [] for name in labels}
    pools: dict[str, list[list[str]]] = {name: [] for name in labels}
    for group in groups:
        if all(len(test[n]) >= n_test and len(val[n]) >= n_val and len(pools[n]) >= cap for n in labels):
            break  # train takes one text from each of its first `cap` groups: later groups change no split
        by_class = {name: sorted(texts) for name, texts in sorted(members[group].items()) if name in labels}
        for texts in by_class.values():
            rng.shuffle(texts)
        held_out = next(
            (split for split, need in ((test, n_test), (val, n_val)) if any(len(split[n]) < need for n in by_class)),
            None,
        )
        for name, texts in by_class.items():
            if held_out is None:
                pools[name].append(texts)
            elif len(held_out[name]) < (n_test if held_out is test else n_val):
                held_out[name].append(texts[0])

    thin = [name for name in labels if len(test[name]) < n_test or len(val[name]) < n_val]
    if thin:
        raise AccuracyDataError(f"classes {thin} have too few groups for {n_test} test and {n_val} val texts each")
    train = {
        name: [texts[r] for r in range(max(map(len, pool), default=0)) for texts in pool if r < len(texts)]
        for name, pool in pools.items()
    }
    n_train = min(cap, *(len(texts) for texts in train.values()))
    if n_train * n_classes < sizes.min_train:
        thinnest = min(labels, key=lambda name: len(train[name]))
        raise AccuracyDataError(
            f"only {n_train} training texts per class are left (class {thinnest}); "
            f"{sizes.min_train} in all ({sizes.min_train // n_classes} per class) are required"
        )
    index = {name: i for i, name in enumerate(labels)}

    def finish(split: dict[str, list[str]], per_class: int) -> list[tuple[str, int]]:
        rows = [(text, index[name]) for name in labels for text in split[name][:per_class]]
        rng.shuffle(rows)
        return rows

    return TaskSplits(labels, finish(train, n_train), finish(val, n_val), finish(test, n_test))
