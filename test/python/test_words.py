"""The tree speaks of the product only.

Code, comments, tests, scripts and documents state what the code does and why (the invariant, or
a measured figure with its device), never how the work on it was organised (the patterns below
say which words that takes), nor dates of past changes. And the user documentation
(README.md, docs/) never points outside the repository: what a reader needs is in it.

Both checks read the files git knows (tracked, plus new files that are not ignored), so they see
what a commit would carry, not build outputs or virtual environments.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

#: Measured records (results JSON, plots, tables) are data: they carry run metadata by design.
DATA_UNDER = ("benchmarks/results/",)
DATA_SUFFIXES = (".json", ".png", ".txt")

# Ordinals that number pieces of work history (see the cases below). The first three are left out ("the first call compiles" is a fact about the product), and so are
# fractions ("a fifth of the slots").
_ORDINAL = (
    r"(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
    r"|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth)"
)
_COMPOUND_ORDINAL = (
    r"(?:twenty|thirty|forty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
)
# A number after "run" / "call" that is a measurement or a count, not an identifier:
# "first call 36.6 ms", "profiled call 1,849.9 ms", "runs 4 members".
_NOT_AN_IDENTIFIER = (
    r"(?![.,]\d)"
    r"(?!\s*(?:ns|us|µs|ms|s|min|h|x|%)(?![\w-]))"
    r"(?!\s+(?:members|tables|threads|times|tests|cases|cells|workers|processes|steps|iterations"
    r"|warps|blocks|programs|rows|columns|kernels|calls|launches|stages|passes|repeats|rounds"
    r"|epochs|seeds|configurations|jobs|batches|queries|keys|heads|tokens|features|gpus|cores"
    r"|copies|samples|trials|seconds|minutes|hours|bytes|graphs|buckets|shapes|models)\b)"
)
# The word's other senses: a process group (start_new_session's), a user's shell.
_OTHER_SESSIONS = "".join(
    f"(?<!{word} )" for word in ("own", "new", "process", "interactive", "python", "shell", "login")
)

#: (what the words say, pattern): each match is one hit, matched case-insensitively.
FORBIDDEN = (
    ("a work session", _OTHER_SESSIONS + r"\bsessions?\b"),
    (
        "a work sitting",
        r"\bsittings\b|\bsitting's|\b(?:this|that|the|same|each|every|per|next|last|earlier|previous"
        rf"|later|one|a|first|second|third|{_ORDINAL}|{_COMPOUND_ORDINAL})\s+sitting\b",
    ),
    ("a run number", r"\bruns? #?\d+\b" + _NOT_AN_IDENTIFIER),
    ("a call number", r"\bcalls? #?\d+\b" + _NOT_AN_IDENTIFIER),
    ("an issue number", r"\bissues?[ -]?#?\d+\b"),
    # Dates in quotes are data (a datetime column's values in a test).
    ("a date", r"(?<![\w'\"-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?![\w'\"-])"),
    (
        "an ordinal of work history",
        rf"(?<!\ba )(?<!\bone )\b{_ORDINAL}(?:\s+(?:device\s+|work\s+)?(?:runs?|calls?)\b|'s\b"
        rf"|\))|\b{_COMPOUND_ORDINAL}\b",
    ),
)
_FORBIDDEN = [(what, re.compile(pattern, re.IGNORECASE)) for what, pattern in FORBIDDEN]


def repository_files() -> list[Path]:
    """The files a commit would carry (tracked ones still on disk, and unignored new ones)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = sorted({name for name in listed.decode().split("\0") if name})
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def is_data(relative: str) -> bool:
    return relative.startswith(DATA_UNDER) and relative.endswith(DATA_SUFFIXES)


def word_hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the matched words) for every forbidden phrase in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in _FORBIDDEN:
            hits.extend((number, what, match.group(0)) for match in pattern.finditer(line))
    return hits


def test_no_work_history_in_the_tree():
    hits = []
    for path in repository_files():
        relative = path.relative_to(ROOT).as_posix()
        if path.resolve() == THIS or is_data(relative):
            continue
        text = text_of(path)
        if text is None:
            continue
        by_line: dict[int, list[str]] = {}
        for number, what, words in word_hits(text):
            by_line.setdefault(number, []).append(f"{words!r} ({what})")
        hits += [f"{relative}:{n}: {'; '.join(found)}" for n, found in by_line.items()]
    assert not hits, f"{len(hits)} lines about how the work was organised:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line",
    [
        "the weights of the ninth session's kernel",
        "# Fifth session, H200: 3.2 ms",
        "c46 took 121.5 ms in run 16 against 123.0 in run 15",
        "Run 19 (H200): 121.3 ms",
        "runs 16-19 merged",
        "(call 3, tree of ef2e9cc)",
        "calls 1 and 2 ran the tests",
        "Issue 5 recipes",
        "the stream target of issue #5",
        "the issue-3 report",
        "(H200, 2026-12-01)",
        "twenty-sixth",
        "host launch included (eighth).",
        "in the thirteenth run",
        "shared with other sessions",
        "entries per sitting",
        "a later sitting",
    ],
)
def test_the_word_check_finds_work_history(line):
    assert word_hits(line), line


@pytest.mark.parametrize(
    "line",
    [
        "a member runs 4 members' tables",
        "cold first call 50.3 s; priming run 42.5 s",
        "profiled call 1,849.9 ms",
        "the large train call 3.40 against 2.04 ms",
        "start_new_session=True,  # its own process group",
        "Runs ``command`` in its own session",
        "Both kernels sitting at ~4.9 ms",
        "wastes at most about a fifth of them",
        "tenth = torch.full((2, 4), 0.1).half()",
        'pd.to_datetime(["2024-01-01"])',
        "tabicl 2.2.0, torch 2.11.0+cu130",
        "the first call compiles, the second replays",
    ],
)
def test_the_word_check_leaves_product_text_alone(line):
    assert not word_hits(line), word_hits(line)


# Markdown link targets: [text](target "title"), ![alt](target), [label]: target, and HTML
# href / src attributes.
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_LINK = re.compile(
    r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*$"
)
_HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_CODE_SPAN = re.compile(r"`+[^`]*`+")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
#: Places outside the repository that a document must not name, linked or not.
_OUTSIDE_PATHS = re.compile(r"(?:^|[\s(\[<\"'`=])(?:\.\./shared\b|/work/)")


def documentation_files() -> list[Path]:
    return [
        path
        for path in repository_files()
        if path.relative_to(ROOT).as_posix() in ("README.md",)
        or path.relative_to(ROOT).as_posix().startswith("docs/")
    ]


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside fenced code blocks and code spans."""
    targets, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = _CODE_SPAN.sub("", line)
        for pattern in (_INLINE_LINK, _REFERENCE_LINK, _HTML_LINK):
            targets += [(number, match.group(1)) for match in pattern.finditer(prose)]
    return targets


def outside_the_repository(document: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``document``) leaves the repository, or None if it does not."""
    if target.startswith("#"):
        return None
    if target.lower().startswith("file:"):
        return "a file: URL"
    if _SCHEME.match(target):
        return None  # a web page, which is not a path of this machine
    if target.startswith("/"):
        return "an absolute path"
    path = target.split("#", 1)[0].split("?", 1)[0]
    resolved = (document.parent / path).resolve()
    if not resolved.is_relative_to(ROOT.resolve()):
        return "a path outside the repository"
    if not resolved.exists():
        return "a path that does not exist in the repository"
    return None


def test_documentation_stays_inside_the_repository():
    problems = []
    for document in documentation_files():
        text = text_of(document)
        if text is None:
            continue
        relative = document.relative_to(ROOT).as_posix()
        for number, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE_PATHS.search(line):
                problems.append(f"{relative}:{number}: names a path outside the repository")
        for number, target in link_targets(text):
            why = outside_the_repository(document, target)
            if why:
                problems.append(f"{relative}:{number}: link {target!r} is {why}")
    assert not problems, "\n".join(problems)


def test_the_link_check_reads_markdown_links():
    text = "\n".join(
        [
            "See [the notes](../shared/notes.md) and ![plot](results/h200.png 'H200').",
            "[ref]: <docs/guide/serving.md>",
            "[tables, rows]: train rows first",
            '<img src="/work/plot.png">',
            "`a[0](x)` is code, and so is",
            "```",
            "[not a link](../outside.md)",
            "```",
        ]
    )
    assert link_targets(text) == [
        (1, "../shared/notes.md"),
        (1, "results/h200.png"),
        (2, "docs/guide/serving.md"),
        (4, "/work/plot.png"),
    ]
    readme = ROOT / "README.md"
    assert outside_the_repository(readme, "../shared/notes.md") == "a path outside the repository"
    assert outside_the_repository(readme, "/work/plot.png") == "an absolute path"
    assert outside_the_repository(readme, "https://pytorch.org/docs") is None
    assert outside_the_repository(readme, "#install") is None
    assert outside_the_repository(readme, "test/python/test_words.py#L1") is None
    assert _OUTSIDE_PATHS.search("notes in ../shared/notes.md") and _OUTSIDE_PATHS.search(
        "cd /work/main"
    )


#: A document of the tree named in code, comments or another document: ``docs/guide/serving.md``.
_NAMED_DOCUMENT = re.compile(r"(?<![\w/.-])docs/[\w./-]*\w\.md\b")


def test_named_documents_exist():
    """A pointer to a document (``see docs/reference/ops.md``) names a file that is there, so
    moving a document means updating what points at it."""
    missing = []
    for path in repository_files():
        relative = path.relative_to(ROOT).as_posix()
        if path.resolve() == THIS or is_data(relative):
            continue
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in _NAMED_DOCUMENT.finditer(line):
                if not (ROOT / match.group(0)).is_file():
                    missing.append(f"{relative}:{number}: {match.group(0)}")
    assert not missing, "documents named but not in the tree:\n" + "\n".join(missing)
