"""The guides stay true to the tree: every path docs/internals.md names exists, and every relative link in the
README and the guides leads to an existing file (and, with a #fragment, to a heading of it).

The commands the README and the guides show are run in tests/test_readme.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOTS = ("reefd/", "recipes/", "tests/", "bench/", "scenarios/", "systemd/", "docs/")  # top-level folders
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
TICKED = re.compile(r"`([^`\s]+)`")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def exists(path: Path) -> bool:
    """A file or folder; a name with `*` must match at least one."""
    return any(path.parent.glob(path.name)) if "*" in path.name else path.exists()


def named_paths(text: str) -> list[str]:
    """The repository paths a page names in inline code: those that start at a top-level folder, and, in a table
    row whose first cell is such a folder (`reefd/observe/`), the files and folders the row names relative to it
    (`records.py`, `gates/`). Placeholders (`<name>/recipe.py`) are skipped."""
    paths: list[str] = []
    for line in prose(text).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        first = TICKED.fullmatch(cells[0]) if cells else None
        base = first.group(1) if first and first.group(1).startswith(ROOTS) and first.group(1).endswith("/") \
            else None
        for token in TICKED.findall(line):
            if "<" in token or token.startswith(("http:", "https:")) or token.split("/")[0].isupper():
                continue  # placeholders, addresses, and paths under STATE or HOME
            if token.startswith(ROOTS):
                paths.append(token.rstrip(".,;:"))
            elif base is not None and re.fullmatch(r"[\w*.-]+(/[\w*.-]+)*(\.py|/)", token):
                paths.append(base + token)
    return paths


def test_every_path_the_code_map_names_exists() -> None:
    paths = named_paths((ROOT / "docs" / "internals.md").read_text())
    assert len(paths) >= 20, f"found only {len(paths)} module paths in docs/internals.md: is the extraction broken?"
    missing = sorted({p for p in paths if not exists(ROOT / p)})
    assert not missing, f"docs/internals.md names paths that do not exist: {missing}"


def test_the_path_extraction_sees_full_and_row_relative_paths() -> None:
    text = ("See `reefd/observe/records.py` and `reefd/commit/gates/`.\n\n| Path | Owns |\n|---|---|\n"
            "| `reefd/cli/` | `main.py`, `*_verbs.py`; `STATE/jobs/`, `<name>/recipe.py` |\n"
            "```\n`reefd/nowhere.py`\n```\n")
    assert named_paths(text) == ["reefd/observe/records.py", "reefd/commit/gates/", "reefd/cli/", "reefd/cli/main.py",
                                 "reefd/cli/*_verbs.py"]
    assert exists(ROOT / "reefd/cli/*_verbs.py") and not exists(ROOT / "reefd/cli/*_nothing.py")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline-code ticks and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, https:, mailto:


def test_every_relative_link_leads_to_an_existing_file_and_heading() -> None:
    broken: list[str] = []
    count = 0
    for page in DOCS:
        for target in relative_links(page):
            count += 1
            file, _, fragment = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{fragment})")
    assert count >= 20, f"found only {count} relative links in the README and docs/: is the extraction broken?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_maps_every_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    unmapped = [p.name for p in DOCS[1:] if f"(docs/{p.name})" not in readme]
    assert not unmapped, f"guides the README does not link: {unmapped}"
