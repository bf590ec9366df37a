"""The docs stay true: every relative link and anchor resolves, every `path.py:Symbol` they cite exists,
every docs/ page the code cites exists, the README stays a landing page, and the persona checklist
answers each question with a link."""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

LINK = re.compile(r"(?<!\\)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CITATION = re.compile(r"\b((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
DOCS_CITED_IN_CODE = re.compile(r"\bdocs/[\w/.-]+\.md")


def markdown_files() -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(ROOT / p for p in tracked if (ROOT / p).exists())


def prose(text: str) -> str:
    """The text outside fenced code blocks (links and citations in code are not the docs' own)."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text()))
    return frozenset(found)


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))
    return LINK.findall(text)


def broken_link(source: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None  # a URL
    file, _, anchor = target.partition("#")
    dest = (source.parent / file).resolve() if file else source
    if not dest.exists():
        return f"{target}: no such file"
    if ROOT not in dest.parents and dest != ROOT:
        return f"{target}: outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = [
        f"{md.relative_to(ROOT)}: {problem}"
        for md in markdown_files()
        for target in links(md)
        if (problem := broken_link(md, target))
    ]
    assert not broken, "\n".join(broken)


@cache
def defined_names(path: Path) -> dict[str, ast.AST]:
    tree = ast.parse(path.read_text())
    return names_in(tree)


def names_in(node: ast.AST) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[child.name] = child
        elif isinstance(child, ast.Assign):
            for target in child.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = child
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names[child.target.id] = child
        elif isinstance(child, (ast.If, ast.Try)):
            names.update(names_in(child))
    return names


def resolves(path: Path, symbol: str) -> bool:
    """``Class.method`` names a path from the module's top; a lone name may be nested anywhere in it."""
    scope = defined_names(path)
    for part in symbol.split("."):
        node = scope.get(part)
        if node is None:
            return "." not in symbol and any(
                getattr(node, "name", None) == symbol for node in ast.walk(ast.parse(path.read_text()))
            )
        scope = names_in(node)
    return True


def cited_file(file: str) -> Path | None:
    """A cited path from the repository's root, or, as the architecture pages write inside a package
    (``runs/live_run.py``), the one file whose path ends so."""
    if (ROOT / file).exists():
        return ROOT / file
    skip = {".venv", ".cache", "tests"}
    matches = [p for p in ROOT.glob(f"*/**/{file}") if not skip & set(p.relative_to(ROOT).parts)]
    return matches[0] if len(matches) == 1 else None


def test_every_cited_path_and_symbol_exists() -> None:
    missing = []
    for md in markdown_files():
        for file, symbol in CITATION.findall(md.read_text()):
            path = cited_file(file)
            if path is None:
                missing.append(f"{md.relative_to(ROOT)}: {file} does not exist (or is ambiguous)")
            elif not resolves(path, symbol):
                missing.append(f"{md.relative_to(ROOT)}: {file} defines no {symbol}")
    assert not missing, "\n".join(missing)


def test_every_docs_page_the_code_cites_exists() -> None:
    sources = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = []
    for name in sources:
        if name.endswith(".md") or not (ROOT / name).is_file():
            continue
        try:
            text = (ROOT / name).read_text()
        except UnicodeDecodeError:
            continue
        for cited in DOCS_CITED_IN_CODE.findall(text):
            if not (ROOT / cited).exists():
                missing.append(f"{name}: {cited}")
    assert not missing, "\n".join(missing)


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def checklist_questions() -> list[tuple[str, list[str]]]:
    rows = []
    for line in (ROOT / "docs" / "checklist.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0] not in ("persona", "---"):
            if set(cells[0]) <= {"-", ":"}:
                continue
            rows.append((cells[1], LINK.findall(cells[2])))
    return rows


def test_checklist_answers_every_question_with_a_link() -> None:
    rows = checklist_questions()
    assert len(rows) >= 12, "the checklist holds the three personas' questions"
    unanswered = [question for question, answers in rows if not answers]
    assert not unanswered, unanswered


@pytest.mark.parametrize(
    "must_have",
    ["image", "weights", "tensor", "JWKS", "scale", "upgrade", "region", "retry", "drain", "OpenAI"],
)
def test_checklist_covers_the_issues_questions(must_have: str) -> None:
    questions = " ".join(q for q, _ in checklist_questions())
    assert must_have.lower() in questions.lower()
