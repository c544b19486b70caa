"""The documents' links and flags: every relative link names a file that exists, every anchor a
heading of its target (GitHub's slugs), and every ``--flag`` a document gives to ``objfs``
is one that ``objfs``'s parser knows.

The documents are the README and the ones it links for other readers (k8s/, systemd/,
tests/benchmarks/). A flag is checked where it is objfs's: in a code span or a code-block line
that starts with ``objfs``, and, in the user documents, in the first cell of an option table's
row; other tools' flags (docker's, vLLM's, the benchmark scripts') are left alone.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from objfs.options import build_parser

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = ["README.md", "k8s/README.md", "systemd/README.md"]
DOCS = [*USER_DOCS, "tests/benchmarks/README.md"]

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N"))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return _LINK.findall(text)


def known_flags() -> set[str]:
    flags: set[str] = set()

    def walk(parser: object) -> None:
        for action in getattr(parser, "_actions", []):
            flags.update(o for o in action.option_strings if o.startswith("--"))
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):  # subcommands
                for sub in choices.values():
                    walk(sub)

    walk(build_parser())
    return flags


def objfs_flags(path: Path, user_doc: bool) -> set[str]:
    """The flags the document gives to objfs (see the module docstring)."""
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            if line.strip().startswith(("objfs ", "sudo objfs ")):
                found.update(_FLAG.findall(line))
            continue
        if user_doc and line.startswith("| `--"):  # an option table's row
            found.update(_FLAG.findall(line.split("|")[1]))
        for span in _CODE_SPAN.findall(line):
            if span.startswith(("objfs ", "sudo objfs ")):
                found.update(_FLAG.findall(span))
    return found


def test_the_readme_stays_short() -> None:
    """What a user needs first; the rest lives in the documents it links."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 700


def test_the_user_documents_are_there_and_say_who_they_are_for() -> None:
    for name in DOCS[1:]:
        head = (REPO / name).read_text().split("\n\n")[1]
        assert head.startswith("For "), (name, head[:80])
    readme = (REPO / "README.md").read_text()
    for name in DOCS[1:]:
        assert f"]({name}" in readme, f"README does not link {name}"


@pytest.mark.parametrize("name", DOCS)
def test_every_link_and_anchor_points_somewhere(name: str) -> None:
    path = REPO / name
    broken = []
    for target in links(path):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == []


@pytest.mark.parametrize("name", DOCS)
def test_every_objfs_flag_named_is_known(name: str) -> None:
    unknown = objfs_flags(REPO / name, name in USER_DOCS) - known_flags()
    assert unknown == set()


def test_the_checks_catch_mistakes(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## A heading, with punctuation!\n\n[ok](#a-heading-with-punctuation) "
        "[bad](#nowhere) [file](missing.md)\n\n| `--no-such-flag N` | 1 |\n\n"
        "`objfs mount --cache-proxy`\n"
    )
    assert anchors(doc) == {"title", "a-heading-with-punctuation"}
    assert links(doc) == ["#a-heading-with-punctuation", "#nowhere", "missing.md"]
    assert objfs_flags(doc, True) - known_flags() == {"--no-such-flag"}
    assert "--cache-proxy" in known_flags()
