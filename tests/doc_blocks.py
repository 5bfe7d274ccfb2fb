"""The fenced code blocks of the README and of the documentation site (docs/), read for the doc tests.

A page's blocks, in order, are what tests/test_docs_commands.py runs:

- ```bash, ```sh, ```shell and ```console blocks are commands (in a ```console block only the lines that start with
  ``$ `` are; the others are output);
- ```python blocks are Python, run in one namespace per page;
- every other block (```yaml, ```text, ``` without a language, ...) is data or output and is not run.

An HTML comment right before a block (only blank lines between) marks it:

- ``<!-- doctest: skip REASON -->``: not run; the test reports the block as skipped with REASON (a GPU, the network,
  inputs of gigabytes, hours of work, an install from the registry);
- ``<!-- doctest: demo-output -->`` on an output block: the output of ``specmerge demo --workdir demo-models``, which
  tests/test_docs_commands.py compares with what the demo prints.

``<!-- doctest: skip-page REASON -->`` anywhere in a page skips all of its blocks with that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
PYTHON_LANGUAGES = frozenset({"python", "py"})
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARK = re.compile(r"^\s*<!--\s*doctest:\s*(?P<kind>[\w-]+)\s*(?P<text>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository, e.g. "docs/hub.md"
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mark: str | None  # "skip", "demo-output", ... from the comment right before the fence
    mark_text: str  # the comment's text after the kind (a skip's reason)

    @property
    def kind(self) -> str:
        """``"command"``, ``"python"`` or ``"data"`` (not run)."""
        if self.language in COMMAND_LANGUAGES:
            return "command"
        if self.language in PYTHON_LANGUAGES:
            return "python"
        return "data"

    @property
    def script(self) -> str:
        """The code to run: for a ```console block its ``$ `` lines without the prompt, else the block as written."""
        if self.language != "console":
            return self.code
        return "".join(line[2:] + "\n" for line in self.code.splitlines() if line.startswith("$ "))

    def first_command(self) -> str:
        """The block's first line that is not a comment or blank, for test ids and messages."""
        for line in self.script.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                return line.strip()
        return "(comments only)"


def doc_pages() -> list[Path]:
    """README.md, then every Markdown page under docs/, in path order."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the doctest mark right before it (if any)."""
    page = path.relative_to(REPO).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        language = opening["info"].strip().split(" ")[0].lower() if opening["info"].strip() else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not _closes(lines[j], fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        mark, text = _mark_before(lines, i)
        blocks.append(Block(page, i + 1, language, "\n".join(body) + "\n", mark, text))
        i = j + 1
    return blocks


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a block opened by ``fence``: the same character, at least as many, nothing else."""
    stripped = line.strip()
    return len(line) - len(line.lstrip(" ")) <= 3 and len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _mark_before(lines: list[str], i: int) -> tuple[str | None, str]:
    k = i - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    found = MARK.match(lines[k]) if k >= 0 else None
    return (found["kind"], found["text"]) if found else (None, "")


def page_skip(path: Path) -> str | None:
    """The reason of a ``<!-- doctest: skip-page REASON -->`` in the page, else None."""
    for line in path.read_text(encoding="utf-8").splitlines():
        found = MARK.match(line)
        if found and found["kind"] == "skip-page":
            return found["text"]
    return None
