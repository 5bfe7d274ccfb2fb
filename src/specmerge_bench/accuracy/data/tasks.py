"""The eight tasks, each a pure function of parsed sources, a data seed and the split sizes (package docstring)."""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

from specmerge_bench.accuracy.data.parse import Sources, Synset, split_description
from specmerge_bench.accuracy.data.splits import SplitSizes, TaskSplits, balanced_splits

POS_NAMES = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
NAME_MASK = "[MASK]"
TASKS = (
    "noun_gloss_supersense",
    "verb_gloss_supersense",
    "monosemous_noun_supersense",
    "example_pos",
    "word_relation",
    "word_language",
    "fragment_language",
    "package_section",
)


def lemma_of(word: str) -> str:
    return word.replace("_", " ").lower()


def group_of(synset: Synset) -> str:
    return f"{synset.key[0]}{synset.offset:08d}"


def gloss_supersense(
    synsets: Sequence[Synset], pos: str, seed: int, sizes: SplitSizes, n_classes: int = 12
) -> TaskSplits:
    """Definition of a ``pos`` synset -> its lexicographer file (supersense)."""
    candidates = [(s.definition, s.lexname, group_of(s)) for s in synsets if s.pos == pos and s.definition]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def monosemous_noun_supersense(
    synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 12
) -> TaskSplits:
    """Lemma with exactly one sense in all of WordNet, that sense a noun -> its lexicographer file."""
    senses = Counter(lemma for s in synsets for lemma in {lemma_of(w) for w in s.words})
    candidates = [
        (lemma, s.lexname, group_of(s))
        for s in synsets
        if s.pos == "n"
        for lemma in sorted({lemma_of(w) for w in s.words})
        if senses[lemma] == 1
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def example_lemma(words: Sequence[str], sentence: str) -> str:
    """The first word whose form starts a word of ``sentence`` (case-insensitive), else the first word."""
    lowered = sentence.lower()
    for word in words:
        if re.search(r"\b" + re.escape(lemma_of(word)), lowered):
            return lemma_of(word)
    return lemma_of(words[0])


def example_text(words: Sequence[str], example: str) -> str:
    """``"lemma: example sentence"``, the lemma chosen by ``example_lemma``."""
    return f"{example_lemma(words, example)}: {example}"


def example_pos(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 4) -> TaskSplits:
    """``"lemma: example sentence"`` -> part of speech of the lemma's synset (noun, verb, adjective, adverb)."""
    candidates = [
        (example_text(s.words, example), POS_NAMES[s.pos], group_of(s)) for s in synsets for example in s.examples
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def word_relation(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 5) -> TaskSplits:
    """``"w1 / w2"`` -> synonym, antonym, hypernym, part-of or unrelated (pairs as in the module docstring)."""
    rng = random.Random(seed)
    by_key = {s.key: s for s in synsets}
    related: set[tuple[str, str, str]] = set()
    for s in synsets:
        distinct = list(dict.fromkeys(lemma_of(w) for w in s.words))
        if len(distinct) >= 2:
            related.add((distinct[0], distinct[1], "synonym"))
        for p in s.pointers:
            target = by_key.get((p.pos, p.offset))
            if target is None:
                continue
            if p.symbol == "!":
                w1 = s.words[p.source - 1] if p.source else s.words[0]
                w2 = target.words[p.target - 1] if p.target else target.words[0]
                related.add((lemma_of(w1), lemma_of(w2), "antonym"))
            elif p.symbol in ("@", "#p"):
                relation = "hypernym" if p.symbol == "@" else "part-of"
                related.add((lemma_of(s.words[0]), lemma_of(target.words[0]), relation))
    pairs = sorted(pair for pair in related if pair[0] != pair[1])

    senses: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for s in synsets:
        for word in s.words:
            senses[lemma_of(word)].add(s.key)
    linked = {(s.key, (p.pos, p.offset)) for s in synsets for p in s.pointers}
    linked |= {(b, a) for a, b in linked}
    seconds = [w2 for _, w2, _ in pairs]
    rng.shuffle(seconds)
    unrelated = [
        (w1, w2, "unrelated")
        for (w1, _, _), w2 in zip(pairs, seconds, strict=True)
        if w1 != w2
        and not senses[w1] & senses[w2]
        and not any((a, b) in linked for a in senses[w1] for b in senses[w2])
    ]
    candidates = [(f"{w1} / {w2}", relation, " / ".join(sorted((w1, w2)))) for w1, w2, relation in pairs + unrelated]
    return balanced_splits(candidates, n_classes, sizes, rng)


def word_language(
    word_lists: Mapping[str, Sequence[str]],
    seed: int,
    sizes: SplitSizes,
    n_classes: int = 8,
    min_length: int = 4,
    capitalised_nouns: Sequence[str] = ("german",),
) -> TaskSplits:
    """A single word -> the language of the one word list it is in (filters in the module docstring)."""
    forms: dict[str, set[str]] = {}
    for language in sorted(word_lists):
        forms[language] = {
            word.lower()
            for word in word_lists[language]
            if len(word) >= min_length
            and word.isalpha()
            and word[1:].islower()
            and (word[0].islower() or language in capitalised_nouns)
        }
    lists_of = Counter(word for words in forms.values() for word in words)
    candidates = [
        (word, language, word) for language in sorted(forms) for word in sorted(forms[language]) if lists_of[word] == 1
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


_PLAIN_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")


def _is_plain_word(token: str) -> bool:
    return _PLAIN_WORD.fullmatch(token.strip(".,;:!?()[]\"'«»“”„")) is not None


def fragment_language(
    translations: Mapping[str, Sequence[Mapping[str, str]]],
    seed: int,
    sizes: SplitSizes,
    n_classes: int = 7,
    n_words: int = 4,
    per_description: int = 4,
) -> TaskSplits:
    """``n_words`` consecutive words of a package's long description -> the description's language."""
    rng = random.Random(seed)
    english = {
        stanza["Description-md5"]: split_description(stanza["Description-en"])[1]
        for stanza in translations.get("en", ())
    }
    candidates = []
    for language in sorted(translations):
        field = f"Description-{language}"
        for stanza in sorted(translations[language], key=lambda s: (s["Package"], s["Description-md5"])):
            long = split_description(stanza[field])[1]
            if language != "en" and long == english.get(stanza["Description-md5"]):
                continue
            tokens = long.split()
            windows = [
                " ".join(tokens[i : i + n_words])
                for i in range(0, len(tokens) - n_words + 1, n_words)
                if all(_is_plain_word(token) for token in tokens[i : i + n_words])
            ]
            for text in rng.sample(windows, min(per_description, len(windows))):
                candidates.append((text, language, stanza["Package"]))
    return balanced_splits(candidates, n_classes, sizes, rng)


def mask_names(text: str, names: Iterable[str]) -> str:
    """``text`` with whole-word, case-insensitive occurrences of each name replaced by ``NAME_MASK``."""
    for name in sorted(set(names), key=lambda n: (-len(n), n)):
        text = re.sub(rf"(?<![\w.+-]){re.escape(name)}(?![\w+-])", NAME_MASK, text, flags=re.IGNORECASE)
    return text


def package_texts(
    packages: Sequence[Mapping[str, str]], english: Sequence[Mapping[str, str]], required: Sequence[str] = ()
) -> Iterator[tuple[Mapping[str, str], str, str]]:
    """(stanza, English ``"short. long"`` description with the package and source names masked, source package)
    per binary package: its first stanza (by name, then version) that has a description and every ``required``
    field."""
    descriptions = {stanza["Description-md5"]: stanza["Description-en"] for stanza in english}
    seen = set()
    for stanza in sorted(packages, key=lambda s: (s["Package"], s.get("Version", ""))):
        name = stanza["Package"]
        description = descriptions.get(stanza.get("Description-md5", ""))
        if name in seen or any(field not in stanza for field in required) or not description:
            continue
        seen.add(name)
        short, long = split_description(description)
        source = stanza.get("Source", name).split()[0]
        yield stanza, mask_names(f"{short}. {long}" if long else short, (name, source)), source


def package_section(
    packages: Sequence[Mapping[str, str]],
    english: Sequence[Mapping[str, str]],
    seed: int,
    sizes: SplitSizes,
    n_classes: int = 10,
) -> TaskSplits:
    """English package description with its names masked -> Debian section (component prefix dropped)."""
    candidates = [
        (text, stanza["Section"].rsplit("/", 1)[-1], source)
        for stanza, text, source in package_texts(packages, english, required=("Section",))
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def derive_tasks(
    sources: Sources, seed: int = 0, sizes: SplitSizes | None = None, names: Sequence[str] = TASKS
) -> dict[str, TaskSplits]:
    """The tasks of ``names`` (default: all eight, ``TASKS`` order) from parsed sources, in that order."""
    sizes = sizes or SplitSizes()
    english = sources.translations.get("en", [])
    derivations = {
        "noun_gloss_supersense": lambda: gloss_supersense(sources.synsets, "n", seed, sizes),
        "verb_gloss_supersense": lambda: gloss_supersense(sources.synsets, "v", seed, sizes),
        "monosemous_noun_supersense": lambda: monosemous_noun_supersense(sources.synsets, seed, sizes),
        "example_pos": lambda: example_pos(sources.synsets, seed, sizes),
        "word_relation": lambda: word_relation(sources.synsets, seed, sizes),
        "word_language": lambda: word_language(sources.word_lists, seed, sizes),
        "fragment_language": lambda: fragment_language(sources.translations, seed, sizes),
        "package_section": lambda: package_section(sources.packages, english, seed, sizes),
    }
    return {name: derivations[name]() for name in names}
