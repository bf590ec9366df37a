"""One-off audit of the README's split into docs/ (issue 55): lists every measurement the README held at
7400f3e (a paragraph, list item or table row with a number and a unit), the date it carries or sits
under, and where its text lives now, or why it was dropped. Its output is committed as
docs/benchmarks/readme-history.md:

    .venv/bin/python scripts/readme_history.py > docs/benchmarks/readme-history.md

A block is found when its words, in order, appear in one page (punctuation, quotes, link targets and
heading marks aside: the split turned bold leads into headings and quoted names into links).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "7400f3e"
MEASUREMENT = re.compile(
    r"\d[\d,.]*\s?(?:ms|µs|s\b|x\b|%|tok/s|tokens|streams|KiB|MiB|GiB|GB|TB|cores?|requests|ops/s|cases"
    r"|decisions|sends|answers|events)",
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def blocks(lines: list[str]) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item and table row outside code blocks."""
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    in_code = False

    def close() -> None:
        if current:
            found.append((start, " ".join(current)))
            current.clear()

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            close()
            in_code = not in_code
            continue
        if in_code:
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("|"):
            close()
            if stripped.startswith("|") and not set(stripped) <= set("|-: "):
                found.append((number, stripped))
            continue
        if re.match(r"^\s*[-*] ", line) or not current:
            close()
            start = number
        current.append(stripped)
    close()
    return found


def words(text: str) -> str:
    text = re.sub(r"\[[^\]]*\.md\]\([^)]*\)", " ", text)  # links named by their file: both changed
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets changed with the move
    text = re.sub(r"\b(?:the )?README,?\s", " ", text)
    return " " + " ".join(re.findall(r"\w+", text.lower())) + " "


def heading_anchor(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def locate(needle: str, pages: dict[str, list[str]]) -> str | None:
    """``page#anchor`` of the heading above the first line where ``needle``'s words are."""
    for page, lines in pages.items():
        if needle not in words("\n".join(lines)):
            continue
        key = needle.split()[:8]
        heading = ""
        for line in lines:
            if line.startswith("#"):
                heading = heading_anchor(line.lstrip("#"))
            if " ".join(key) in words(line):
                break
        return f"[{page}](../../{page}{'#' + heading if heading else ''})"
    return None


def main() -> int:
    old = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:README.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pages = {
        name: (ROOT / name).read_text().splitlines()
        for name in sorted(tracked)
        if (ROOT / name).exists() and name != "docs/benchmarks/readme-history.md"
    }
    date = "undated"
    rows = []
    counts = {"moved": 0, "missing": 0}
    for number, text in blocks(old):
        own = DATE.findall(text)
        if old[number - 1].startswith("#") or own:
            date = own[0] if own else date
        if not MEASUREMENT.search(text):
            continue
        where = locate(words(text), pages)
        counts["moved" if where else "missing"] += 1
        excerpt = re.sub(r"[|`*\[\]]", "", text)[:90].strip()
        rows.append(f"| {number} | {own[0] if own else date} | {excerpt}… | {where or '**not found**'} |")
    out = [
        "# Where the old README's measurements went",
        "",
        f"Generated once by `scripts/readme_history.py` from the README at `{OLD_COMMIT}` (3,490 lines), when",
        "its history moved onto these pages. Each row is a paragraph, list item or table row that held a",
        "measurement; its date is the one it states, else the last one stated above it. Found "
        f"{counts['moved']}, not found {counts['missing']}. Nothing measured was dropped; what was rewritten",
        "rather than moved held no measurement: the introduction (now the README's first paragraph) and the",
        "services' flag tables (now [the flag reference](../reference/flags.md), generated from `--help`).",
        "",
        "| old line | date | text | now |",
        "|---:|---|---|---|",
        *rows,
    ]
    print("\n".join(out))
    return 0 if counts["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
