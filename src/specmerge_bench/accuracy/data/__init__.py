"""Data stage of the offline accuracy benchmark: balanced text-classification tasks from Debian packages.

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
hashes the source hashes, the data seed, the split sizes and the source code of this package's modules, the
ones that build the data (:func:`specmerge_bench.accuracy.data.store.code_hash`: every module of the package but
its command line, ``__main__.py``), so a rerun with the same inputs does nothing and a change to any of them
rebuilds the tasks. Delete ``sources/`` to fetch newer indexes.

Modules: :mod:`.fetch` (apt, the source record), :mod:`.parse` (WordNet, word lists, deb822 indexes),
:mod:`.splits` (balanced group-disjoint splits), :mod:`.tasks` (the eight derivations), :mod:`.more_tasks`
(eight more, for the 16-task setting: ``MORE_TASKS``, its docstring states them), :mod:`.store`
(split files, the cache key, ``build_tasks``); ``python -m specmerge_bench.accuracy.data --cache DIR`` builds
the tasks and prints a table.
"""

from specmerge_bench.accuracy.data.fetch import (
    APT_PACKAGES,
    DESCRIPTION_LANGUAGES,
    WORD_LIST_DIR,
    WORD_LISTS,
    WORDNET_DIR,
    WORDNET_FILES,
    AccuracyDataError,
    fetch_sources,
    sha256_file,
)
from specmerge_bench.accuracy.data.more_tasks import MORE_TASKS, derive_more_tasks
from specmerge_bench.accuracy.data.parse import (
    LEXNAMES,
    Pointer,
    Sources,
    Synset,
    parse_deb822,
    parse_word_list,
    parse_wordnet_data,
    read_sources,
    split_description,
)
from specmerge_bench.accuracy.data.splits import SplitSizes, TaskSplits, balanced_splits
from specmerge_bench.accuracy.data.store import (
    SPLITS,
    build_tasks,
    code_hash,
    read_split,
    tasks_key,
    write_split,
    write_tasks,
)
from specmerge_bench.accuracy.data.tasks import (
    NAME_MASK,
    POS_NAMES,
    TASKS,
    derive_tasks,
    example_pos,
    example_text,
    fragment_language,
    gloss_supersense,
    mask_names,
    monosemous_noun_supersense,
    package_section,
    package_texts,
    word_language,
    word_relation,
)

__all__ = [
    "APT_PACKAGES",
    "DESCRIPTION_LANGUAGES",
    "LEXNAMES",
    "MORE_TASKS",
    "NAME_MASK",
    "POS_NAMES",
    "SPLITS",
    "TASKS",
    "WORDNET_DIR",
    "WORDNET_FILES",
    "WORD_LISTS",
    "WORD_LIST_DIR",
    "AccuracyDataError",
    "Pointer",
    "Sources",
    "SplitSizes",
    "Synset",
    "TaskSplits",
    "balanced_splits",
    "build_tasks",
    "code_hash",
    "derive_more_tasks",
    "derive_tasks",
    "example_pos",
    "example_text",
    "fetch_sources",
    "fragment_language",
    "gloss_supersense",
    "mask_names",
    "monosemous_noun_supersense",
    "package_section",
    "package_texts",
    "parse_deb822",
    "parse_word_list",
    "parse_wordnet_data",
    "read_sources",
    "read_split",
    "sha256_file",
    "split_description",
    "tasks_key",
    "word_language",
    "word_relation",
    "write_split",
    "write_tasks",
]
