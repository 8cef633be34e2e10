"""docs/flags.md read as a user reads it, and every ``--flag`` the docs name.

tests/test_launcher_flags.py checks that docs/flags.md is what ``flags_markdown`` prints; these
check that what it prints is right: each option findable under every spelling, its default the
value a user gets without it, its choices listed; and that a flag named anywhere in the README or
docs/ is one that some parser takes (a launcher flag then being in flags.md by the first check).
"""

from __future__ import annotations

import argparse
import re
from functools import cache

import pytest

import launcher_flags
from tests.test_docs import DOCS, REPO, script_parser

FLAGS_MD = REPO / "docs" / "flags.md"
PARSER = launcher_flags.build_parser()
OPTIONS = [a for a in PARSER._actions if a.option_strings and a.dest != "help"]
DOC_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")  # not "--no-" alone
SCRIPT = re.compile(r"python -m (bench\.\w+|client)\b")
# Flags the docs name that belong to other programs.
FOREIGN_FLAGS = {
    "--no-deps": "pip install",
    "--no-binary": "pip download",
    "--check": "ruff format",
    "--spec-type": "llama.cpp's llama-server (docs/benchmarks-history.md compares its speculation)",
    "--spec-ngram-simple-size-n": "llama.cpp's llama-server",
    "--spec-ngram-simple-size-m": "llama.cpp's llama-server",
    "--spec-draft-n-max": "llama.cpp's llama-server",
}


def flags_md_rows() -> dict[str, tuple[str, str]]:
    """docs/flags.md's table: every spelling in a row's flag cell -> (its default cell, its what cell)."""
    rows: dict[str, tuple[str, str]] = {}
    for line in FLAGS_MD.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]  # a help's "\|" stays in its cell
        if len(cells) != 5 or not cells[1].startswith("`-"):
            continue
        for spelling in re.findall(r"`(-[^`]+)`", cells[1]):
            rows[spelling] = (cells[2], cells[3])
    return rows


def _value(argv: list[str], dest: str) -> object:
    return getattr(PARSER.parse_args(argv), dest)


@pytest.mark.parametrize("action", OPTIONS, ids=lambda a: a.option_strings[0])
def test_flags_md_lists_every_spelling_and_choice(action: argparse.Action) -> None:
    rows = flags_md_rows()
    for spelling in action.option_strings:  # a --x / --no-x flag: both, each findable
        assert spelling in rows, f"docs/flags.md has no row for {spelling}"
    what = rows[action.option_strings[0]][1]
    for choice in action.choices or ():
        assert f"`{choice}`" in what, f"docs/flags.md: {action.option_strings[0]} does not list `{choice}`"


@pytest.mark.parametrize("action", OPTIONS, ids=lambda a: a.option_strings[0])
def test_flags_md_default_is_what_you_get_without_the_flag(action: argparse.Action) -> None:
    rows = flags_md_rows()
    assert action.option_strings[0] in rows, f"docs/flags.md has no row for {action.option_strings[0]}"
    default, what = rows[action.option_strings[0]]
    without = _value([], action.dest)
    if default == "" or without is None:
        assert (default, without) == ("", None), (
            f"{action.option_strings[0]}: default {default!r}, got {without!r}"
        )
        # Decided at start or no value; a switch left unset must say in its help what it does then.
        assert action.nargs != 0 or "default" in what, f"{action.option_strings[0]}: no default stated"
        return
    if action.nargs != 0:
        assert default == f"`{without}`", f"{action.option_strings[0]}: documented {default}, got {without!r}"
        return
    # A switch: "off" means the positive spelling is not given, "on" that it is; never True/False,
    # which for --disable-... reads the wrong way round.
    positive, *negations = action.option_strings
    assert default in ("on", "off"), f"{positive}: a switch's default reads on or off, not {default}"
    assert (_value([positive], action.dest) == without) == (default == "on"), f"{positive}: not {default}"
    for negation in negations:
        assert (_value([negation], action.dest) == without) == (default == "off"), (
            f"{negation}: not {default}"
        )


@cache
def _script_options(module: str) -> frozenset[str]:
    return _options(script_parser(module))


def _options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every option string ``parser`` takes, its subcommands' included."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action.choices, dict):  # subparsers: name -> parser
            for sub in action.choices.values():
                out |= _options(sub)
    return frozenset(out)


def test_every_flag_the_docs_name_is_one_a_parser_takes() -> None:
    """A launcher flag the docs tell users to pass (``--tune-threads`` in cpu.md) exists, so by the
    tests above it is in flags.md; a bench or client flag exists in a script the docs run."""
    known = set(_options(PARSER)) | set(FOREIGN_FLAGS)
    texts = {path: path.read_text() for path in DOCS}
    for module in sorted({m for text in texts.values() for m in SCRIPT.findall(text)}):
        known |= _script_options(module)
    unknown = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
        for path, text in texts.items()
        for m in DOC_FLAG.finditer(text)
        if m.group() not in known
    ]
    assert not unknown, "flags no parser takes:\n" + "\n".join(unknown)
