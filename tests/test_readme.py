"""The README and the user docs: every Python block runs (local workers) or compiles (the others),
every relative link and anchor resolves, and the README stays a user's page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest
from _server_helpers import python_run, subprocess_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages whose Python blocks are run or compiled, besides the README
DOC_PAGES = [ROOT / "docs" / name for name in ("api.md", "concepts.md", "distribution.md", "caching.md",
                                                 "fault-tolerance.md")]
# every Markdown page of the project whose links are checked
MARKDOWN = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
REMOTE_MARKERS = ("workers=[", "WorkerAddresses(", "StoreDiscovery(", "Hostfile(")
README_MAX_LINES = 350


def python_blocks(page: Path) -> List[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def uses_local_workers(block: str) -> bool:
    return "RPCReadingService(" in block and not any(marker in block for marker in REMOTE_MARKERS)


def blocks_of(pages: List[Path]) -> Dict[str, str]:
    """``page:index`` -> block, each distinct block once (a page may repeat the README's)."""
    found: Dict[str, str] = {}
    for page in pages:
        for index, block in enumerate(python_blocks(page)):
            if block not in found.values():
                found[f"{page.name}:{index}"] = block
    return found


BLOCKS = blocks_of([README, *DOC_PAGES])
LOCAL = {name: block for name, block in BLOCKS.items() if uses_local_workers(block)}
OTHERS = {name: block for name, block in BLOCKS.items() if not uses_local_workers(block)}
# the block run in a fresh interpreter; the others are forked from an interpreter that imported torch
FRESH_BLOCK = next(block for name, block in LOCAL.items() if name.startswith("README"))


def test_readme_has_runnable_blocks():
    assert len([name for name in LOCAL if name.startswith("README")]) >= 3, \
        "the README should show runnable local-worker examples"


@pytest.mark.parametrize("block", OTHERS.values(), ids=OTHERS.keys())
def test_other_blocks_compile(block):
    compile(block, "README.md", "exec")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", LOCAL.values(), ids=LOCAL.keys())
def test_local_worker_blocks_run(block, tmp_path):
    script = tmp_path / "readme_block.py"
    script.write_text(block)
    if block == FRESH_BLOCK:  # as a user runs it: a fresh interpreter
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
        )
    else:  # a script too, forked from the tests' forkserver (torch imported already)
        result = python_run([str(script)], subprocess_env(PYTHONWARNINGS="ignore"), str(tmp_path), timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]


def prose_lines(page: Path) -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` of ``page`` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    """Every heading anchor of ``page``, with GitHub's ``-1``, ``-2`` for repeated headings."""
    found: Set[str] = set()
    counts: Dict[str, int] = {}
    for _, line in prose_lines(page):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return found


def broken_links(page: Path) -> Iterator[str]:
    """``page:line target`` of every relative link whose file or anchor does not exist."""
    for number, line in prose_lines(page):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                yield f"{page.relative_to(ROOT)}:{number} {target}: no such file"
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                yield f"{page.relative_to(ROOT)}:{number} {target}: no such heading"


def test_every_relative_link_resolves():
    broken = [link for page in MARKDOWN for link in broken_links(page)]
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_a_missing_file_and_heading(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `part` (2)\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#its-part-2) [b](other.md#nothing) [c](gone.md) [d](#here)\n"
                    "```\n[e](inside-code.md)\n```\n## Here\n[f](https://example.org/x)\n")
    assert list(broken_links(page)) == ["page.md:1 other.md#nothing: no such heading", "page.md:1 gone.md: no such file"]


def test_readme_is_a_short_page_for_users():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"
    dated = [f"{n}: {line}" for n, line in prose_lines(README)
             if re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b|load average", line)]
    assert dated == [], "dated runs belong in benchmarks/NOTES.md:\n" + "\n".join(dated)


def test_no_ticket_numbers_in_the_docs():
    tickets = [f"{page.relative_to(ROOT)}:{n}: {line}" for page in MARKDOWN for n, line in prose_lines(page)
               if re.search(r"\bissues? \d+|\bthe issue's\b|(?<![\w/])#\d+\b", line, re.I)]
    assert tickets == [], "say what the target is, not the ticket:\n" + "\n".join(tickets)
