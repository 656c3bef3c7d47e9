"""The tree states facts about the code, not the history of how it was made: no run numbers of the
suite, CI stops, periods of work, "of mine", "this machine" (as the machine a figure came from),
commit ids in prose, or files that are not in the repository (DESIGN.md, NOTES.md).

Measurements keep their date, command and machine on docs/performance.md, the one page where the
code measured is named by its commit.
"""

from __future__ import annotations

import re

from tests.conftest import ROOT

FOLDERS = ("isbflow", "tests", "bench", "spark_apps", "dags", "plugins", "docs", "infra", "scripts")
FILES = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "pyproject.toml", "Makefile", "mkdocs.yml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".html", ".java", ".sh", ".cfg", ".conf", ""}
#: "session" only as a period of work: an ordinal or a pointer before it, never a SparkSession,
#: a NATS or HTTP session, a process session or the pytest fixture scope
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|previous|earlier|later|"
             "next|last|this|that")
WORDS = re.compile("|".join((
    r"\brun\d+\b",                                        # run73 of the suite
    r"\bof mine\b",
    rf"\b(?:{_ORDINALS}) (?:work )?session\b(?!['\u2019]s (?:JVM|jar|conf))(?!\s*(?:fixture|scope))",
    r"\bsession before\b",
    r"\bwork session\b",
    r"\bCI(?:'s)? (?:at )?stop \d+",
    r"\bthis machine\b",
    r"\b(?:DESIGN|NOTES)\.md\b",
)), re.I)
#: a commit id in prose: 7-10 hex digits holding both a digit and a letter, standing alone
COMMIT = re.compile(r"(?<![\w\-./#:'\"=])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,10}(?![\w\-])")
COMMITS_ALLOWED = {"docs/performance.md"}
HERE = "tests/test_history_words.py"


def files():
    for name in FILES:
        yield ROOT / name
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def test_no_history_words_in_the_tree():
    found = []
    for path in files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == HERE or not path.exists():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            hits = [m.group(0) for m in WORDS.finditer(line)]
            if rel not in COMMITS_ALLOWED:
                hits += [m.group(0) for m in COMMIT.finditer(line)]
            if hits:
                found.append(f"{rel}:{n}: {hits}: {line.strip()[:120]}")
    assert not found, "state the fact without the history:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_mean_and_spare_spark_sessions():
    # synthetic sentences of each kind the patterns refuse (none names a real run, stop or commit)
    assert WORDS.search("a batch went missing (" + "run" + "1 of the suite)")
    assert WORDS.search("measured in the second " + "session") and WORDS.search("nothing else of " + "mine ran")
    assert WORDS.search("CI " + "stop 1's test") and WORDS.search("see " + "DESIGN.md")
    assert COMMIT.search("at " + "abc1234, twice")
    for fine in ("one SparkSession for the whole suite", 'scope="session"', "the session's time zone",
                 "async with session(settings) as nc", "the next SparkSession finds it", "run_available_now",
                 "a process group and session", "isb-logs-in-raw-0", "sha256:ab12cd34ef", "k#41040"):
        assert not WORDS.search(fine) and not COMMIT.search(fine), fine
