"""bench.speculative's reading of each engine's acceptance counts from its log."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

from bench.lib.launch import Server
from bench.speculative import drafted


def server(name: str, log: Path) -> Server:
    """What drafted() reads of a server: its name and its log."""
    return cast(Server, SimpleNamespace(name=name, log_path=log))


def test_rivulet_counts_are_its_last_cumulative_line(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "Speculative decoding. #drafted-token: 10, #accepted-token: 7, accept rate: 70.0%\n"
        "Speculative decoding. #drafted-token: 25, #accepted-token: 20, accept rate: 80.0%\n"
    )
    assert drafted(server("ngram", log)) == (25, 20)


def test_llama_cpp_counts_are_the_sum_of_its_per_request_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "slot print_timing: id  0 | task 5 | "
        "draft acceptance = 0.57143 (    4 accepted /     7 generated), mean len =  1.50\n"
        "srv  update_slots: all slots are idle\n"
        "slot print_timing: id  1 | task 9 | "
        "draft acceptance = 0.90000 (   18 accepted /    20 generated), mean len =  3.10\n"
    )
    assert drafted(server("llama.cpp ngram", log)) == (27, 22)
    assert drafted(server("llama.cpp", tmp_path / "server.log")) == (27, 22)
    log.write_text("no speculation here\n")
    assert drafted(server("llama.cpp", log)) == (0, 0)
