"""How each field of a process config gets its value: from a launcher flag, or from elsewhere.

Every field of WorkerConfig, SchedulerConfig and TokenizerConfig is declared with
``flag(...)`` or ``given(...)``; the launcher (launcher_flags.py) builds its command
line from the ``flag`` fields (name, help, default, type, choices) and each process
config from the parsed flags plus the ``given`` values, so a field cannot be left
unwired: tests/test_launcher_flags.py checks that every field is one or the other and
that every flag's value arrives in its config. Plain metadata: no argparse here.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field
from typing import Any

FLAG_KEY = "rivulet_flag"
GIVEN_KEY = "rivulet_given"


@dataclass(frozen=True)
class Flag:
    """A launcher flag that sets one config field (the field's name is the argparse dest).

    ``name``: the flag's spelling, by default ``--field-name``. A bool field is a switch:
    default False gives ``--name`` (store_true), default True needs a ``--disable-...``
    name (store_false); ``negatable`` gives ``--name/--no-name``. ``unset_default`` is what
    the command line holds when the flag is not given, where that differs from the field's
    default (None: the launcher fills in a value that depends on something else).
    """

    help: str
    name: str | None = None
    choices: tuple[str, ...] | None = None
    negatable: bool = False
    unset_default: Any = ...

    def spelling(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def flag(default: Any, help: str, **options: Any) -> Any:
    """A config field set by a launcher flag (see ``Flag``)."""
    return field(default=default, metadata={FLAG_KEY: Flag(help, **options)})


def given(default: Any, source: str) -> Any:
    """A config field no flag sets: the launcher passes it in, from ``source``."""
    return field(default=default, metadata={GIVEN_KEY: source})


def flag_of(f: Field[Any]) -> Flag | None:
    return f.metadata.get(FLAG_KEY)


def source_of(f: Field[Any]) -> str | None:
    return f.metadata.get(GIVEN_KEY)


# Fields two process configs share: declared here once, so one flag feeds both alike.


def max_running_requests_field() -> Any:
    return flag(128, "the cap on admitted, unfinished requests (each holds a row of the page table)")


def seed_field() -> Any:
    return flag(0, "the worker's torch seed; the tokenizer draws per-request sampling seeds from it")


def mmproj_field() -> Any:
    return flag(
        None,
        "a vision-language model's tower from llama.cpp's mmproj GGUF (Gemma 3's), in place of the HF "
        "directory's; a GGUF model's image processor is built from it (docs/images.md)",
    )
