"""The 16-task setting's eight more tasks, on small synthetic WordNet synsets and Debian package stanzas."""

from collections import Counter

import pytest

import specmerge_bench.accuracy.data as acc
from specmerge_bench.accuracy.data import more_tasks
from specmerge_bench.accuracy.data.parse import Synset

SIZES = acc.SplitSizes(test=12, val=12, max_train=48, min_train=0)
POS = {"n": "noun.artifact", "v": "verb.motion", "a": "adj.all", "r": "adv.all"}


def synset(pos: str, offset: int, lexname: str, words: list[str], definition: str = "", examples=()) -> Synset:
    return Synset(pos, offset, lexname, tuple(words), (), definition, tuple(examples))


def wordnet() -> list[Synset]:
    """Per POS 10 synsets with a definition; lemmas with 1, 2, 3 and 5 senses (10 each); 6 verb and 6 noun
    lexnames with 10 synsets of 2 examples each."""
    out, offset = [], 1000
    for pos, lexname in POS.items():
        for i in range(10):
            offset += 1
            out.append(synset(pos, offset, lexname, [f"{pos}word{i}"], f"{pos} definition number {i}"))
    for bucket, senses in (("one", 1), ("two", 2), ("three", 3), ("five", 5)):
        for i in range(10):
            for _ in range(senses):
                offset += 1
                out.append(synset("n", offset, "noun.state", [f"{bucket}{i}", f"pad{offset}"]))
    for pos, lexnames in (("v", [f"verb.k{j}" for j in range(6)]), ("n", [f"noun.k{j}" for j in range(6)])):
        for lexname in lexnames:
            for i in range(10):
                offset += 1
                word = f"{lexname[-2:]}x{i}"
                examples = [f"we {word} once {offset}", f"they {word} twice {offset}"]
                out.append(synset(pos, offset, lexname, [word], "", examples))
    return out


TEAMS = [f"Debian Team{chr(65 + j)} Team" for j in range(10)]
ROLES = ("program", "shared-lib", "devel-lib", "documentation", "app-data")


def packages() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """120 source packages of two binaries each (Packages stanzas and their Translation-en), tags, maintainers,
    architectures and Multi-Arch cycling over the classes; some with two roles, a person as maintainer, or no
    Multi-Arch field."""
    stanzas, english = [], []
    for s in range(120):
        for b in range(2):
            name = f"pkg{s}-{b}"
            tags = f"role::{ROLES[s % 5]}, implemented-in::c" + (", role::plugin" if s % 15 == 7 else "")
            maintainer = TEAMS[s % 10] if s % 13 else "Jane Doe"
            md5 = f"{s:04d}{b}"
            stanzas.append({"Package": name, "Version": "1.0", "Source": f"src{s} (1.0)", "Tag": tags,
                            "Maintainer": f"{maintainer} <team{s}@example.org>", "Description-md5": md5,
                            "Architecture": "all" if s % 2 else "amd64",
                            **({"Multi-Arch": ("same", "foreign")[s % 2]} if s % 11 else {})})  # fmt: skip
            english.append({"Package": name, "Description-md5": md5,
                            "Description-en": f"tool {s} binary {b}\n pkg{s}-{b} from src{s} does {s}."})  # fmt: skip
    return stanzas, english


@pytest.fixture(scope="module")
def sources() -> acc.Sources:
    stanzas, english = packages()
    return acc.Sources(wordnet(), {}, {"en": english}, stanzas)


def groups(name: str, sources: acc.Sources) -> dict[str, str]:
    """text -> its group, recomputed from the synthetic sources as the task's docstring defines it."""
    if name.startswith("package_"):
        return {text: source for _, text, source in acc.package_texts(sources.packages, sources.translations["en"])}
    out = {}
    for s in sources.synsets:
        out[s.definition] = f"{s.pos}{s.offset:08d}"
        for example in s.examples:
            out[acc.example_text(s.words, example)] = f"{s.pos}{s.offset:08d}"
        for word in s.words:
            out[word] = word
    return out


N_CLASSES = {"gloss_pos": 4, "lemma_sense_count": 4, "verb_example_supersense": 6, "noun_example_supersense": 6,
             "package_multi_arch": 2, "package_role": 5, "package_maintainer_team": 10,
             "package_architecture": 2}  # fmt: skip


@pytest.mark.parametrize("name", more_tasks.MORE_TASKS)
def test_every_new_task_is_balanced_group_disjoint_and_deterministic(sources, name):
    task = acc.derive_more_tasks(sources, 0, SIZES, [name])[name]
    assert len(task.labels) == N_CLASSES[name] and list(task.labels) == sorted(task.labels)
    for split in acc.SPLITS:
        counts = Counter(label for _, label in getattr(task, split))
        assert set(counts) == set(range(len(task.labels))) and len(set(counts.values())) == 1, (split, counts)
    group_of = groups(name, sources)
    split_groups = [{group_of[text] for text, _ in getattr(task, split)} for split in acc.SPLITS]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not split_groups[i] & split_groups[j], (name, acc.SPLITS[i], acc.SPLITS[j])
    assert acc.derive_more_tasks(sources, 0, SIZES, [name])[name] == task
    assert acc.derive_more_tasks(sources, 1, SIZES, [name])[name].train != task.train


def test_the_new_tasks_label_what_the_sources_say(sources):
    tasks = acc.derive_more_tasks(sources, 0, SIZES)
    by_text = {name: {text: task.labels[label] for split in acc.SPLITS for text, label in getattr(task, split)}
               for name, task in tasks.items()}  # fmt: skip
    assert by_text["gloss_pos"]["r definition number 3"] == "adverb"
    assert (
        by_text["lemma_sense_count"].get("five4", "5+") == "5+" and by_text["lemma_sense_count"].get("two1", "2") == "2"
    )
    assert set(tasks["lemma_sense_count"].labels) == {"1", "2", "3-4", "5+"}
    assert set(tasks["package_maintainer_team"].labels) == set(TEAMS)  # "Jane Doe" is no team
    for text, team in by_text["package_maintainer_team"].items():
        assert team == TEAMS[int(text.split()[1]) % 10] and int(text.split()[1]) % 13
    for text, role in by_text["package_role"].items():
        assert role == ROLES[int(text.split()[1]) % 5] and int(text.split()[1]) % 15 != 7  # two roles: out
    for text, multi_arch in by_text["package_multi_arch"].items():
        assert multi_arch == ("same", "foreign")[int(text.split()[1]) % 2] and int(text.split()[1]) % 11
    for text, arch in by_text["package_architecture"].items():
        assert arch == ("all" if int(text.split()[1]) % 2 else "compiled")
        assert "pkg" not in text and "[MASK]" in text  # package and source names masked


def test_build_tasks_refuses_unknown_task_names(tmp_path, monkeypatch):
    monkeypatch.setattr(acc.store, "fetch_sources", lambda cache: {"packages": {}, "indexes": {}, "files": {}})
    with pytest.raises(acc.AccuracyDataError, match="unknown tasks"):
        acc.build_tasks(tmp_path, names=("gloss_pos", "no_such_task"))
