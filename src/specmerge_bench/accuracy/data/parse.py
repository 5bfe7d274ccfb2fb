"""Parsing the fetched sources: WordNet 3.0 ``data.*`` files, ``/usr/share/dict`` word lists, deb822 indexes."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specmerge_bench.accuracy.data.fetch import WORD_LIST_DIR, WORD_LISTS, WORDNET_DIR, WORDNET_FILES, AccuracyDataError

# WordNet 3.0 lexicographer files, indexed by the number in data.* lines (lexnames(5WN)).
LEXNAMES = (
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
)


@dataclass(frozen=True)
class Pointer:
    """A WordNet pointer; ``source`` / ``target`` are 1-based word numbers, 0 for the whole synset."""

    symbol: str
    offset: int
    pos: str  # n, v, a or r: satellites (s) live in data.adj, so they are addressed as a
    source: int
    target: int


@dataclass(frozen=True)
class Synset:
    """One line of a WordNet ``data.<pos>`` file."""

    pos: str  # n, v, a, s (adjective satellite) or r
    offset: int
    lexname: str
    words: tuple[str, ...]  # as stored (underscores for spaces), adjective markers such as (p) removed
    pointers: tuple[Pointer, ...]
    definition: str
    examples: tuple[str, ...]

    @property
    def key(self) -> tuple[str, int]:
        """(pos of its data file, offset): what pointers address."""
        return _file_pos(self.pos), self.offset


@dataclass(frozen=True)
class Sources:
    """Parsed sources: WordNet synsets, word lists by language, Translation stanzas by language, Packages."""

    synsets: list[Synset]
    word_lists: dict[str, list[str]]
    translations: dict[str, list[dict[str, str]]]
    packages: list[dict[str, str]]


def _file_pos(pos: str) -> str:
    return "a" if pos == "s" else pos


def parse_wordnet_data(lines: Iterable[str], source: str = "WordNet data") -> list[Synset]:
    """Synsets of one WordNet 3.0 ``data.<pos>`` file (wndb(5WN)); license lines (leading spaces) are skipped."""
    synsets = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith(" "):
            continue
        head, _, gloss = line.partition("|")
        f = head.split()
        try:
            n_words = int(f[3], 16)
            at = 4 + 2 * n_words
            pointers = tuple(
                Pointer(f[i], int(f[i + 1]), _file_pos(f[i + 2]), int(f[i + 3][:2], 16), int(f[i + 3][2:], 16))
                for i in range(at + 1, at + 1 + 4 * int(f[at]), 4)
            )
            lexname = LEXNAMES[int(f[1])]
            offset = int(f[0])
        except (IndexError, ValueError) as err:
            raise AccuracyDataError(f"{source} line {number} is not a WordNet data line: {line[:60]!r}") from err
        words = tuple(re.sub(r"\([a-z]+\)$", "", word) for word in f[4:at:2])
        gloss = gloss.strip()
        definition = gloss.split('"', 1)[0].strip().rstrip(";").strip()
        examples = tuple(e.strip() for e in re.findall(r'"([^"]+)"', gloss) if e.strip())
        synsets.append(Synset(f[2], offset, lexname, words, pointers, definition, examples))
    return synsets


def parse_word_list(data: bytes, encoding: str) -> list[str]:
    """The words of a ``/usr/share/dict`` list (one per line), in file order."""
    return [word for line in data.decode(encoding).split("\n") if (word := line.strip())]


def parse_deb822(text: str) -> list[dict[str, str]]:
    """Stanzas of a Debian control-style file (Packages, Translation-*); continuation lines join with newlines."""
    stanzas: list[dict[str, str]] = []
    stanza: dict[str, str] = {}
    key = ""
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip(" \t\r"):  # only ASCII blanks: a line holding a no-break space is content
            if stanza:
                stanzas.append(stanza)
            stanza, key = {}, ""
        elif line[0] in " \t":
            if not key:
                raise AccuracyDataError(f"line {number}: continuation line outside a field: {line[:60]!r}")
            stanza[key] += "\n" + line[1:]
        else:
            key, sep, value = line.partition(":")
            if not sep:
                raise AccuracyDataError(f"line {number}: expected 'Field: value', got {line[:60]!r}")
            stanza[key] = value.strip()
    if stanza:
        stanzas.append(stanza)
    return stanzas


def split_description(value: str) -> tuple[str, str]:
    """(short, long) of a Description field; long joins its lines with spaces, dropping ``.`` paragraph marks."""
    short, *rest = value.split("\n")
    long = " ".join(line.strip() for line in rest if line.strip() != ".")
    return short.strip(), " ".join(long.split())


def read_sources(cache_dir: str | Path, record: Mapping) -> Sources:
    """Parse the files ``fetch_sources`` recorded."""
    root = Path(cache_dir).resolve() / "sources"
    synsets = []
    for name in WORDNET_FILES:
        path = root / "unpacked" / WORDNET_DIR / name
        synsets += parse_wordnet_data(path.read_text(encoding="utf-8").split("\n"), str(path))
    word_lists = {
        language: parse_word_list((root / "unpacked" / WORD_LIST_DIR / file).read_bytes(), encoding)
        for language, (file, encoding) in WORD_LISTS.items()
    }
    translations: dict[str, list[dict[str, str]]] = defaultdict(list)
    packages: list[dict[str, str]] = []
    for rel in sorted(record["indexes"]):
        stanzas = parse_deb822((root / rel).read_text(encoding="utf-8"))
        match = re.search(r"_Translation-([A-Za-z_]+)$", rel)
        if match:
            translations[match.group(1)] += stanzas
        else:
            packages += stanzas
    return Sources(synsets, word_lists, dict(translations), packages)
