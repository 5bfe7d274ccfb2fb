"""The tensor names of one model saved under another wrapper, found from names and shapes alone.

The same weights are saved under different names depending on the class that saved them: ``BertModel`` writes
``encoder.layer.0.attention.self.query.weight``, ``BertForSequenceClassification`` writes the same tensor as
``bert.encoder.layer.0.attention.self.query.weight``; a ``LlamaForCausalLM`` writes ``model.layers.0...`` and
``lm_head.weight``, the language model inside a Llava checkpoint ``language_model.model.layers.0...`` and
``language_model.lm_head.weight`` (as transformers 5 saves it) or ``model.language_model.layers.0...``; PEFT's
wrapper adds ``base_model.model.``. :func:`find_name_map` maps the names of a ``source`` checkpoint into those
of a ``target`` checkpoint:

1. names both hold are the same tensor (whatever their shapes: a resized vocabulary stays the same tensor);
2. then the one prefix rewrite ``old -> new`` (strip, add or replace a dotted prefix of at most
   :data:`MAX_PREFIX_PARTS` components) that maps the most of the remaining source names onto remaining target
   names of equal shape is applied: every remaining source name starting with ``old`` whose rewritten name is
   a remaining target name is mapped (equal shape or not); repeated while a rewrite adds a match. The part
   of a name a rewrite keeps is at least two components (``classifier.weight`` never becomes ``score.weight``:
   rewrites change wrappers, not modules). Two rewrites that match equally many tensors and send one source
   name to different targets are ambiguous: refused, naming both.
3. Source tensors left unmatched keep their names, rewritten by the longest rewrite whose ``old`` prefix they
   start with (what a wrapper holds stays under the wrapper's new prefix; ``classifier.weight`` outside
   ``bert.`` stays as it is); the caller decides what they are (an expert's own module, or a tensor the output
   drops).

Nothing is hard-coded per architecture: the candidates are all prefix pairs under which some source and
target name agree; their number stays small because a candidate needs a shared name ending of two or more
components.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specmerge.errors import SpecmergeError

MAX_PREFIX_PARTS = 3  # the longest prefix a rewrite strips or adds, in dotted components (base_model.model.model.)
MIN_KEPT_PARTS = 2  # the shortest name ending a rewrite keeps (module and parameter: ``q_proj.weight``)

Shape = tuple[int, ...]


class NameMapError(SpecmergeError):
    """The names of two checkpoints cannot be matched: too few agree, or two prefix rewrites match equally well."""


@dataclass(frozen=True)
class Rewrite:
    """A prefix rewrite ``old -> new`` of tensor names, and how many tensors it matched."""

    old: str  # a dotted prefix ending in '.', or '' (add a prefix)
    new: str
    tensors: int = 0

    def apply(self, name: str) -> str | None:
        """``name`` with ``old`` replaced by ``new``, or None when it does not start with ``old``."""
        return self.new + name[len(self.old) :] if name.startswith(self.old) else None

    def __str__(self) -> str:
        return f"'{self.old}' -> '{self.new}'"


@dataclass
class NameMap:
    """The names of a source checkpoint in a target's namespace.

    ``names`` maps each output name to the source's name, for every source tensor, in source order;
    ``matched`` are the output names that are target names (exact or by a rewrite); the rest are the source's
    own tensors under their (possibly rewritten) names.
    """

    names: dict[str, str]
    exact: int
    rewrites: list[Rewrite] = field(default_factory=list)
    matched: set[str] = field(default_factory=set)

    @property
    def identity(self) -> bool:
        """Whether every tensor keeps its name."""
        return all(out == name for out, name in self.names.items())

    def unmatched(self) -> list[str]:
        """The output names of the source tensors that the target does not hold, in source order."""
        return [out for out in self.names if out not in self.matched]

    def summary(self) -> dict[str, int]:
        """For a report: ``{"exact": n, "'bert.' -> ''": m, ..., "unmatched": k}``."""
        counts = {"exact": self.exact, **{str(r): r.tensors for r in self.rewrites}}
        return {**counts, "unmatched": len(self.names) - len(self.matched)}

    def describe(self) -> str:
        """One line: ``'bert.' -> '' (197 tensors), 12 exact``."""
        parts = [f"{r} ({r.tensors} tensors)" for r in self.rewrites] + [f"{self.exact} exact"]
        return ", ".join(parts)


def identity_map(names: Sequence[str], target: Mapping[str, object] | None = None) -> NameMap:
    """Every name kept; matched: those ``target`` holds (all when no target is given)."""
    matched = {n for n in names if target is None or n in target}
    return NameMap({n: n for n in names}, exact=len(matched), matched=matched)


def _splits(name: str) -> list[tuple[str, str]]:
    """(prefix, rest) pairs of ``name`` cut after 0..MAX_PREFIX_PARTS components, the rest keeping at least
    MIN_KEPT_PARTS components."""
    parts = name.split(".")
    most = min(MAX_PREFIX_PARTS, len(parts) - MIN_KEPT_PARTS)
    return [(".".join(parts[:k]) + "." if k else "", ".".join(parts[k:])) for k in range(most + 1)]


def _candidates(
    sources: Sequence[str], source_shapes: Mapping[str, Shape], targets: Mapping[str, Shape]
) -> dict[tuple[str, str], dict[str, str]]:
    """Every rewrite (old, new) under which some source name lands on a target name of equal shape, with those
    matches (source name -> target name)."""
    index: dict[str, list[tuple[str, str]]] = {}
    for target in targets:
        for prefix, rest in _splits(target):
            index.setdefault(rest, []).append((prefix, target))
    votes: dict[tuple[str, str], dict[str, str]] = {}
    for source in sources:
        shape = source_shapes[source]
        for old, rest in _splits(source):
            for new, target in index.get(rest, ()):
                if old != new and targets[target] == shape:
                    votes.setdefault((old, new), {})[source] = target
    return votes


def _best(votes: dict[tuple[str, str], dict[str, str]], what: str, into: str) -> tuple[str, str]:
    """The rewrite with the most matches (the shortest first among equivalent ones); refuses a tie between two
    rewrites that send one name to different places."""
    most = max(len(v) for v in votes.values())
    tied = sorted((c for c, v in votes.items() if len(v) == most), key=lambda c: (len(c[0]) + len(c[1]), c))
    first = votes[tied[0]]
    for other in tied[1:]:
        clash = next((s for s, t in votes[other].items() if s in first and first[s] != t), None)
        if clash is not None:
            a, b = Rewrite(*tied[0]), Rewrite(*other)
            raise NameMapError(
                f"the tensor names of {what} match those of {into} ambiguously: {a} and {b} each match {most} "
                f"tensors (e.g. '{clash}' -> '{first[clash]}' or '{votes[other][clash]}'); choose another "
                "config_source or save the checkpoints under one wrapper"
            )
    return tied[0]


def find_name_map(
    source: Mapping[str, Sequence[int]], target: Mapping[str, Sequence[int]], *, what: str, into: str
) -> NameMap:
    """Map the tensor names of ``source`` (name -> shape) into those of ``target`` (see the module docstring).

    ``what`` and ``into`` name the two checkpoints in messages (``"expert 'cls'"``, ``"the base"``).
    """
    source_shapes = {n: tuple(int(d) for d in s) for n, s in source.items()}
    remaining_targets = {n: tuple(int(d) for d in s) for n, s in target.items() if n not in source}
    matched_names = {n: n for n in source if n in target}
    remaining = [n for n in source if n not in target]
    rewrites: list[Rewrite] = []
    while remaining and remaining_targets:
        votes = _candidates(remaining, source_shapes, remaining_targets)
        if not votes:
            break
        old, new = _best(votes, what, into)
        left = []
        for name in remaining:
            out = new + name[len(old) :] if name.startswith(old) else None
            if out is not None and out in remaining_targets:
                matched_names[name] = out
                del remaining_targets[out]
            else:
                left.append(name)
        rewrites.append(Rewrite(old, new, len(remaining) - len(left)))
        remaining = left
    names: dict[str, str] = {}
    by_length = sorted(rewrites, key=lambda r: -len(r.old))
    for name in source:
        out = matched_names.get(name)
        if out is None:
            out = next((o for r in by_length if (o := r.apply(name)) is not None), name)
            if out in target or out in names:
                out = name  # a rewritten own tensor never takes a name that is already used
        if out in names:
            raise NameMapError(
                f"{what}: tensors '{names[out]}' and '{name}' would both be named '{out}' in {into}'s names; "
                "save the checkpoint under one wrapper"
            )
        names[out] = name
    matched = {out for out, name in names.items() if matched_names.get(name) == out}
    exact = sum(1 for out, name in names.items() if out == name and out in matched)
    return NameMap(names, exact, rewrites, matched)
