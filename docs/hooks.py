"""MkDocs hooks: pages of the site that are files of the repository root, and docstrings' Sphinx roles.

``docs/benchmarks.md`` is ``BENCHMARKS.md`` and ``docs/contributing.md`` is ``CONTRIBUTING.md``: each stub in
``docs/`` names its file, and this hook puts the file's text in its place, with the links it holds rewritten from
the root's point of view (``docs/img/x.png``, ``docs/page.md``) to the site's (``img/x.png``, ``page.md``). No
network, no plugin: ``mkdocs.yml`` lists this file under ``hooks``.

The docstrings (rendered by mkdocstrings on the API page) write cross-references as Sphinx roles, ``:func:`merge```;
Markdown shows the name as code and would leave the role's prefix in front of it, so the prefix is dropped (and the
``~`` that asks Sphinx for the short name).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDED = {"benchmarks.md": "BENCHMARKS.md", "contributing.md": "CONTRIBUTING.md"}
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "benchmarks.md", "CONTRIBUTING.md": "contributing.md"}
ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):(<code>)~?")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?P<rest>[^)]*)\)")


def site_link(target: str) -> str:
    """A link target of a root file, as a page of the site links it."""
    if target.startswith("docs/"):
        return target[len("docs/") :]
    return ROOT_PAGES.get(target, target)


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = INCLUDED.get(page.file.src_uri)
    if source is None:
        return markdown
    text = (ROOT / source).read_text(encoding="utf-8")
    return LINK.sub(lambda m: f"]({site_link(m['target'])}{m['rest']})", text)


def on_page_content(html: str, page, config, files) -> str:
    return ROLE.sub(r"\1", html)
