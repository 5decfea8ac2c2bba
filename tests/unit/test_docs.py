"""The pages that teach stay pages that teach: no history in them, links that lead somewhere, and the
length a reader can take in.

History (dates, issue numbers, commit hashes, a session's story) belongs in the dated results pages
(docs/results/) and CHANGELOG.md; the READMEs of runs/reference/ are results records too (setup,
commands, commit, machine). Every other markdown page of the repository is scanned."""

import os
import re
from pathlib import Path

import pytest

from conftest import REPO

# Results records: dated by design.
RECORDS = ("docs/results/", "runs/reference/", "CHANGELOG.md")
# What the checkout holds besides tracked pages: environments, run records and reports, build output.
NOT_PAGES = (".venv/", "runs/", "reports/", "build/", "dist/")

HISTORY = {
    "a date": re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b"),
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
}
# A link to a dated results page names its date: the link's target is not the page's text.
RESULTS_LINK = re.compile(r"\]\([^)]*results/[^)]*\)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

LONGEST = {"README.md": 200, "docs/planner.md": 150, "docs/estimator.md": 150}


def teaching_pages() -> list[str]:
    pages = []
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO).as_posix()
        prefix = "" if rel_root == "." else rel_root + "/"
        # Not into .git, .venv, .pytest_cache, ..., nor what runs and builds write.
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info")
                   and not (prefix + d + "/").startswith(NOT_PAGES + RECORDS)]
        pages += [prefix + f for f in files if f.endswith(".md") and not (prefix + f).startswith(RECORDS)]
    runs = REPO / "runs" / "README.md"  # the field reference of a record, beside the records
    return sorted(pages + (["runs/README.md"] if runs.exists() else []))


def history_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the match) for each piece of history in a page's text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = RESULTS_LINK.sub("]()", line)
        for what, pattern in HISTORY.items():
            found += [(number, what, m.group(0)) for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("text, what", [
    ("measured on 2026-11-25 here", "a date"), ("since 2026-12", "a date"),
    ("the zoo of issue 40 showed", "an issue number"), ("(Issue #82)", "an issue number"),
    ("since commit 140ba42", "a commit hash"), ("at ffa3b9b", "a commit hash"),
    ("the session's scripts", "a session"), ("Sessions later", "a session"),
])
def test_the_scan_finds_each_kind_of_history(text, what):
    assert [w for _, w, _ in history_in(text)] == [what]


@pytest.mark.parametrize("text", [
    "see [the planner's results](results/planner_2026-11-26.md#on-a-gpu)",  # a link to a dated page
    "fp16, bf16, 1e-5, 0x10, 86,701,056 parameters, DeepSpeed 0.19.8, sha256 of its file",
    "deadbeef is a word here? no: 8 letters without a digit", "12345678 is a number",
])
def test_the_scan_leaves_what_is_not_history(text):
    assert history_in(text) == []


def test_the_scan_reads_the_pages_that_teach():
    pages = teaching_pages()
    assert {"README.md", "docs/planner.md", "docs/estimator.md", "docs/choosing.md", "runs/README.md",
            "ds_configs/README.md"} <= set(pages)
    assert not [p for p in pages if p.startswith(RECORDS) or p == "CHANGELOG.md"]


def test_no_page_outside_the_results_records_holds_history():
    found = [f"{page}:{number}: {what} ({match!r})" for page in teaching_pages()
             for number, what, match in history_in((REPO / page).read_text())]
    assert not found, "history belongs in docs/results/ or CHANGELOG.md:\n" + "\n".join(found)


def test_every_relative_link_of_a_teaching_page_leads_to_a_file():
    broken = []
    for page in teaching_pages():
        for target in LINK.findall((REPO / page).read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue  # an anchor in the page, or a URL
            if not (REPO / page).parent.joinpath(path).exists():
                broken.append(f"{page}: {target}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page, longest", LONGEST.items())
def test_a_teaching_page_stays_short(page, longest):
    lines = len((REPO / page).read_text().splitlines())
    assert lines <= longest, f"{page} has {lines} lines (at most {longest}): move detail to the page it belongs to"
