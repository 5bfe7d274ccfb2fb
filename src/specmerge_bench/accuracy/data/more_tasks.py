"""The eight further tasks of the 16-task setting, from the same parsed sources (no other package is fetched).

================================  ===========================================  =========================
task                              input text                                   classes (group)
================================  ===========================================  =========================
gloss_pos                         synset definition                            4 POS, s read as a (synset)
lemma_sense_count                 a WordNet lemma                              senses: 1, 2, 3-4, 5+ (lemma)
verb_example_supersense           ``"lemma: example sentence"`` of a verb      6 verb lexnames (synset)
noun_example_supersense           ``"lemma: example sentence"`` of a noun      6 noun lexnames (synset)
package_multi_arch                description, names masked                    Multi-Arch same / foreign (source)
package_role                      description, names masked                    5 debtags roles (source)
package_maintainer_team           description, names masked                    10 packaging teams (source)
package_architecture              description, names masked                    ``all`` or compiled (source)
================================  ===========================================  =========================

The conventions of the first eight (:mod:`specmerge_bench.accuracy.data`) hold: candidates ``(text, class,
group)``, groups never straddle splits, a text seen with two classes is dropped, balanced splits of the same
sizes, the ``n_classes`` classes with the most groups. Choices:

- ``lemma_sense_count``: the number of synsets (any part of speech) a lowercased lemma is a word of, bucketed.
- ``*_example_supersense``: the lemma shown is chosen as in ``example_pos``.
- Package descriptions are the English ``"short. long"`` text of ``package_section`` (Translation-en by
  Description-md5, package and source names masked), grouped by source package; one text per binary package.
- ``package_role``: the debtags ``role::`` facet, packages with exactly one role (tags from the ``Tag`` field
  of the release's ``Packages`` index). The ``interface::`` facet (command line or graphical, the two large
  classes) was tried and left out: 1,151 training texts per class remain, below the 1,200 a two-class task
  needs (``SplitSizes.min_train``).
- ``package_multi_arch``: the ``Multi-Arch`` field, ``same`` (co-installable for several architectures, mostly
  libraries) or ``foreign`` (can satisfy another architecture's dependencies: tools, data); packages without
  the field (or ``allowed``) are left out.
- ``package_maintainer_team``: the ``Maintainer`` name when it is a team (it contains Team, Group or
  Maintainers); the ten teams with the most source packages.
- ``package_architecture``: ``Architecture: all`` (one build for every architecture) or compiled per
  architecture.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from specmerge_bench.accuracy.data.parse import Sources, Synset
from specmerge_bench.accuracy.data.splits import SplitSizes, TaskSplits, balanced_splits
from specmerge_bench.accuracy.data.tasks import POS_NAMES, example_text, group_of, lemma_of, package_texts

MORE_TASKS = (
    "gloss_pos",
    "lemma_sense_count",
    "verb_example_supersense",
    "noun_example_supersense",
    "package_multi_arch",
    "package_role",
    "package_maintainer_team",
    "package_architecture",
)
_TEAM = re.compile(r"\b(team|group|maintainers)\b", re.IGNORECASE)


def gloss_pos(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 4) -> TaskSplits:
    """Definition of a synset -> its part of speech (noun, verb, adjective, adverb)."""
    candidates = [(s.definition, POS_NAMES[s.pos], group_of(s)) for s in synsets if s.definition]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def sense_bucket(n_senses: int) -> str:
    """The class of a lemma with ``n_senses`` synsets."""
    return "1" if n_senses == 1 else "2" if n_senses == 2 else "3-4" if n_senses <= 4 else "5+"


def lemma_sense_count(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 4) -> TaskSplits:
    """A lemma -> how many synsets it belongs to, in all of WordNet (1, 2, 3-4, 5 or more)."""
    senses: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for s in synsets:
        for word in s.words:
            senses[lemma_of(word)].add(s.key)
    candidates = [(lemma, sense_bucket(len(keys)), lemma) for lemma, keys in sorted(senses.items())]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def example_supersense(
    synsets: Sequence[Synset], pos: str, seed: int, sizes: SplitSizes, n_classes: int = 6
) -> TaskSplits:
    """``"lemma: example sentence"`` of a ``pos`` synset -> its lexicographer file (supersense)."""
    candidates = [
        (example_text(s.words, example), s.lexname, group_of(s))
        for s in synsets
        if s.pos == pos
        for example in s.examples
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def debtags(stanza: Mapping[str, str], facet: str) -> set[str]:
    """The values of one debtags facet in a stanza's ``Tag`` field (``facet::value``, comma-separated)."""
    tags = (tag.strip() for tag in stanza.get("Tag", "").replace("\n", " ").split(","))
    return {tag.split("::", 1)[1] for tag in tags if tag.startswith(f"{facet}::")}


def package_facet(
    packages: Sequence[Mapping[str, str]],
    english: Sequence[Mapping[str, str]],
    facet: str,
    seed: int,
    sizes: SplitSizes,
    n_classes: int,
) -> TaskSplits:
    """Package description -> its one value of a debtags ``facet`` (packages with several are left out)."""
    candidates = []
    for stanza, text, source in package_texts(packages, english):
        values = debtags(stanza, facet)
        if len(values) == 1:
            candidates.append((text, values.pop(), source))
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def package_multi_arch(
    packages: Sequence[Mapping[str, str]], english: Sequence[Mapping[str, str]], seed: int, sizes: SplitSizes
) -> TaskSplits:
    """Package description -> its ``Multi-Arch`` field, ``same`` or ``foreign``."""
    candidates = [
        (text, stanza["Multi-Arch"], source)
        for stanza, text, source in package_texts(packages, english)
        if stanza.get("Multi-Arch") in ("same", "foreign")
    ]
    return balanced_splits(candidates, 2, sizes, random.Random(seed))


def package_maintainer_team(
    packages: Sequence[Mapping[str, str]], english: Sequence[Mapping[str, str]], seed: int, sizes: SplitSizes
) -> TaskSplits:
    """Package description -> the packaging team that maintains it."""
    candidates = []
    for stanza, text, source in package_texts(packages, english):
        team = stanza.get("Maintainer", "").split("<")[0].strip()
        if _TEAM.search(team):
            candidates.append((text, team, source))
    return balanced_splits(candidates, 10, sizes, random.Random(seed))


def package_architecture(
    packages: Sequence[Mapping[str, str]], english: Sequence[Mapping[str, str]], seed: int, sizes: SplitSizes
) -> TaskSplits:
    """Package description -> ``all`` (architecture-independent) or ``compiled``."""
    candidates = [
        (text, "all" if stanza.get("Architecture") == "all" else "compiled", source)
        for stanza, text, source in package_texts(packages, english)
    ]
    return balanced_splits(candidates, 2, sizes, random.Random(seed))


def derive_more_tasks(sources: Sources, seed: int, sizes: SplitSizes, names: Sequence[str] = MORE_TASKS) -> dict:
    """The tasks of ``names`` (a subset of ``MORE_TASKS``), in that order."""
    english = sources.translations.get("en", [])
    derivations = {
        "gloss_pos": lambda: gloss_pos(sources.synsets, seed, sizes),
        "lemma_sense_count": lambda: lemma_sense_count(sources.synsets, seed, sizes),
        "verb_example_supersense": lambda: example_supersense(sources.synsets, "v", seed, sizes),
        "noun_example_supersense": lambda: example_supersense(sources.synsets, "n", seed, sizes),
        "package_multi_arch": lambda: package_multi_arch(sources.packages, english, seed, sizes),
        "package_role": lambda: package_facet(sources.packages, english, "role", seed, sizes, 5),
        "package_maintainer_team": lambda: package_maintainer_team(sources.packages, english, seed, sizes),
        "package_architecture": lambda: package_architecture(sources.packages, english, seed, sizes),
    }
    return {name: derivations[name]() for name in names}
