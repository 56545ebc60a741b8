"""The front door: README.md stays short, documents every config key, and every link in it and in
docs/ leads somewhere. Static: reads the Markdown and the config models, runs nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.M)}


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_docs_exist_and_readme_links_every_page():
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ holds no page"
    linked = {Path(target.split("#")[0]).name for target in LINK.findall(README.read_text())}
    assert not set(pages) - linked, f"pages README.md does not link: {sorted(set(pages) - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, broken


def _user_keys() -> list[str]:
    """Every key a user writes, as DeepSpeed's config spells it: the fields of ``zero_optimization``,
    and of the disk tier's the ``aio.X`` key a field's docstring names, else ``offload_optimizer.X``."""
    from ds_patrickstar.disk.config import NvmeOffload
    from ds_patrickstar.integration.config import PatrickStarConfig

    keys = list(PatrickStarConfig.model_fields)
    for name, field in NvmeOffload.model_fields.items():
        aio = re.search(r"``(aio\.\w+)``", field.description or "")
        keys.append(aio.group(1) if aio else f"offload_optimizer.{name}")
    return keys


def test_readme_documents_every_config_key():
    text = README.read_text()
    missing = [k for k in _user_keys() if f"`{k}`" not in text and f"`{k.rpartition('.')[2]}`" not in text]
    assert not missing, f"config keys README.md does not document: {missing}"


def test_the_note_index_lists_every_note_where_it_lives():
    """docs/architecture.md indexes every ``[Note: X]`` header of the package with the module that holds it."""
    package = REPO / "ds_patrickstar"
    headers = {}
    for path in [*package.rglob("*.py"), REPO / "ds_patrickstar_autoload.py"]:
        for match in re.finditer(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", path.read_text(), re.M):
            where = path.relative_to(package) if path.is_relative_to(package) else path.relative_to(REPO)
            headers[match.group(1)] = str(where)
    architecture = (REPO / "docs" / "architecture.md").read_text()
    index = dict(re.findall(r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", architecture, re.M))
    wrong = {name: (where, index.get(name)) for name, where in headers.items() if index.get(name) != where}
    assert not wrong, f"Note -> (module, index entry): {wrong}"
    assert not set(index) - set(headers), f"indexed Notes no module holds: {sorted(set(index) - set(headers))}"
