"""Every command block of the README and of docs/ runs, as a reader would run it (tests/doc_blocks.py reads them).

Design, for speed (these tests run in `make test` on 2 cores):

- One folder per page, fresh for the session (with ``examples/`` linked in, as in the checkout); the page's blocks
  run there in the page's order, so what one block writes the next one reads (a recipe, the demo's models, a
  merge). A block run on its own (``-k``) first runs the blocks of its page before it; each block runs once.
- A command block is one ``bash -e -o pipefail`` script: every command must succeed, as a reader running the lines
  one after another would see. PATH starts with this interpreter's bin folder (the virtualenv's ``specmerge``,
  ``python``), ``HF_HUB_OFFLINE=1`` and ``HF_HOME`` inside the page's folder: nothing is downloaded.
- Python blocks run in this process, in one namespace per page, with the page's folder as the current folder.
- One torch thread (``OMP_NUM_THREADS=1``): the pages' models are tiny, and idle threads spin on a busy machine.
- ``specmerge demo --workdir demo-models`` runs once per session (the ``demo`` fixture, about 40 s); in every
  page after that the same command copies that session's folder and prints the output it printed. The demo's
  output is compared with the README's and the docs' text by ``test_the_demo_prints_what_the_docs_show``.
- A block marked ``<!-- doctest: skip REASON -->`` is reported as skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from doc_blocks import REPO, Block, doc_pages, page_skip, read_blocks

BLOCK_TIMEOUT = 300  # seconds; the longest runnable block takes about 30 s on 2 busy cores
DEMO_FOLDER = "demo-models"
DEMO_COMMAND = re.compile(r"^specmerge demo --workdir (?P<folder>\S+)")


def _runnable() -> list[Block]:
    return [b for page in doc_pages() for b in read_blocks(page) if b.kind != "data"]


def _block_id(block: Block) -> str:
    first = re.sub(r"[^\w.=/-]+", "-", block.first_command())[:48].strip("-")
    return f"{block.page}:{block.line}:{first}"


BLOCKS = _runnable()
PAGE_SKIPS = {page.relative_to(REPO).as_posix(): page_skip(page) for page in doc_pages()}


class Page:
    """One page's folder, Python namespace and the blocks run so far."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.namespace: dict = {"__name__": "__doc__"}
        self.done: set[int] = set()


@pytest.fixture(scope="session")
def doc_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs")


@pytest.fixture(scope="session")
def demo(doc_root) -> tuple[Path, str]:
    """``specmerge demo --workdir demo-models`` once: its folder and what it printed on stdout."""
    folder = doc_root / "_demo"
    folder.mkdir()
    done = subprocess.run(
        ["specmerge", "demo", "--workdir", DEMO_FOLDER],
        cwd=folder,
        env=_environment(folder),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / "demo-output.txt").write_text(done.stdout)
    return folder / DEMO_FOLDER, done.stdout


@pytest.fixture(scope="session")
def pages(doc_root) -> dict[str, Page]:
    return {}


def _environment(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(folder / ".hf-home")
    env.pop("HF_HUB_CACHE", None)
    env["MPLBACKEND"] = "Agg"
    # The pages' models are tiny: one thread is as fast, and torch's idle threads spin on a busy machine (a 100-step
    # AdaMerging took 30 s with two threads beside another job, 7 s with one).
    env["OMP_NUM_THREADS"] = "1"
    return env


def _prelude(demo_folder: Path, demo_output: Path) -> str:
    """A ``specmerge`` shell function: the session's demo for ``specmerge demo --workdir demo-models``, else the
    real command."""
    return f"""specmerge() {{
    if [ "$#" -eq 3 ] && [ "$1" = demo ] && [ "$2" = --workdir ] && [ "$3" = {DEMO_FOLDER} ]; then
        cp -r '{demo_folder}' {DEMO_FOLDER} && cat '{demo_output}'
    else
        command specmerge "$@"
    fi
}}
"""


def _run(block: Block, page: Page, demo: tuple[Path, str]) -> None:
    if block.kind == "command":
        script = page.folder / f".block-{block.line}.sh"
        script.write_text(_prelude(demo[0], demo[0].parent / "demo-output.txt") + block.script)
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", str(script)],
            cwd=page.folder,
            env=_environment(page.folder),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
        if done.returncode != 0:
            pytest.fail(
                f"{block.page}, line {block.line}: exit status {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
                f"\n--- stderr\n{done.stderr[-4000:]}",
                pytrace=False,
            )
        return
    saved_cwd, saved_env, saved_threads = Path.cwd(), dict(os.environ), torch.get_num_threads()
    os.chdir(page.folder)
    os.environ.update({k: v for k, v in _environment(page.folder).items() if k != "PATH"})
    torch.set_num_threads(1)
    try:
        exec(compile(block.script, f"{block.page}:{block.line}", "exec"), page.namespace)
    finally:
        torch.set_num_threads(saved_threads)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.mark.parametrize("block", BLOCKS, ids=_block_id)
def test_doc_block_runs(block: Block, pages: dict[str, Page], doc_root: Path, request) -> None:
    reason = PAGE_SKIPS.get(block.page)
    if reason is not None:
        pytest.skip(f"{block.page}: {reason}")
    if block.mark == "skip":
        pytest.skip(block.mark_text or "marked skip")
    demo = request.getfixturevalue("demo")
    if block.page not in pages:
        folder = doc_root / re.sub(r"\W+", "-", block.page)
        folder.mkdir()
        (folder / "examples").symlink_to(REPO / "examples")  # `python examples/...` as from the checkout
        pages[block.page] = Page(folder)
    page = pages[block.page]
    for earlier in BLOCKS:  # blocks of this page before this one that have not run (a test selected alone)
        if earlier.page == block.page and earlier.line < block.line and earlier.line not in page.done:
            page.done.add(earlier.line)
            if earlier.mark != "skip":
                _run(earlier, page, demo)
    page.done.add(block.line)  # run once: a failure is reported here, not again by the page's later blocks
    _run(block, page, demo)


# The demo's table: the docs show what `specmerge demo --workdir demo-models` printed on one machine. Its scores are
# printed with 4 decimals, computed in float32 (the merges) and float64 (the scores). Another CPU or thread count
# changes float32 sums in their last bits, and a value that lies near a rounding boundary of the fourth decimal can
# then print one unit apart; the closed form D C+ amplifies such differences through its smallest eigenvalues (its
# random-token score moved from 3.9675 to 3.9676 between two machines). So a score matches when it is within one
# unit of the last printed digit plus 1e-4 of its value; "mean K" (kept ranks, printed with 1 decimal) within 0.1 of
# a rank; the "merge s" column (seconds) is not compared. Rows must come in the same order, except that two rows
# whose interference scores are within that tolerance may swap.
TABLE_ROW = re.compile(r"^(?P<method>[a-z_]\w*)\s+(?P<scores>[\d.\s]+)$")


def _demo_table(text: str) -> list[tuple[str, list[float], float | None]]:
    rows = []
    for line in text.splitlines():
        found = TABLE_ROW.match(line.strip())
        if not found or found["method"] == "method":
            continue
        fields = line.split()
        numbers = [float(x) for x in fields[1:]]
        scores, rest = numbers[:3], numbers[3:]
        kept = rest[0] if len(rest) == 2 else None  # mean K is blank for methods without a kept rank
        rows.append((fields[0], scores, kept))
    return rows


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 + 1e-4 * abs(b) + 1e-12


def _demo_outputs() -> list[Block]:
    return [b for page in doc_pages() for b in read_blocks(page) if b.mark == "demo-output"]


def test_the_docs_show_the_demo_output():
    shown = {b.page for b in _demo_outputs()}
    assert {"README.md", "docs/getting-started.md"} <= shown, shown


@pytest.mark.parametrize("block", _demo_outputs(), ids=lambda b: f"{b.page}:{b.line}")
def test_the_demo_prints_what_the_docs_show(block: Block, demo: tuple[Path, str]) -> None:
    printed, shown = _demo_table(demo[1]), _demo_table(block.code)
    assert [r[0] for r in shown], f"{block.page}:{block.line}: no table rows"
    assert sorted(r[0] for r in shown) == sorted(r[0] for r in printed), (
        f"{block.page}:{block.line}: the methods differ from what the demo prints"
    )
    by_method = {r[0]: r for r in printed}
    for method, scores, kept in shown:
        got = by_method[method]
        assert all(_close(a, b) for a, b in zip(got[1], scores, strict=True)), (method, got[1], scores)
        assert (kept is None) == (got[2] is None), (method, got[2], kept)
        assert kept is None or abs(got[2] - kept) <= 0.1 + 1e-9, (method, got[2], kept)
    order = [r[0] for r in printed]
    for i, (method, scores, _kept) in enumerate(shown):
        j = order.index(method)
        if i != j:  # only a swap of rows whose interference scores are within the tolerance
            assert _close(by_method[order[i]][1][0], scores[0]), (
                f"{block.page}:{block.line}: row {i} is {method}, the demo prints {order[i]} there"
            )
    # the text around the table: everything but the time column and machine-dependent paths, line by line
    assert _prose(block.code) == _prose(demo[1]), f"{block.page}:{block.line}: the demo's text differs"


def _prose(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip() and not TABLE_ROW.match(line.strip())]
