"""Launcher flags: each reaches its process config; those whose meaning depends on the worker."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

import launcher
import launcher_flags
from gpu_worker.config import WorkerConfig
from protocol import WorkerReady
from protocol.flags import Flag, flag_of, source_of
from scheduler_proc.config import SchedulerConfig
from tokenizer_proc.config import TokenizerConfig

REPO = Path(__file__).resolve().parent.parent


def _ready(device: str) -> WorkerReady:
    return WorkerReady(pid=1, num_pages=64, page_size=16, context_len=2048, device=device, dtype="bfloat16")


@pytest.mark.parametrize(
    ("flags", "device", "mixed"),
    [
        ([], "cpu", True),  # CPU: a prefill pass of its own would stall every running stream
        ([], "cuda:0", False),  # GPU: as SGLang
        (["--no-enable-mixed-chunk"], "cpu", False),
        (["--enable-mixed-chunk"], "cuda:0", True),
    ],
)
def test_mixed_chunk_follows_the_worker_device_unless_set(flags: list[str], device: str, mixed: bool) -> None:
    args = launcher.build_parser().parse_args(flags)
    assert launcher.scheduler_config(args, _ready(device)).enable_mixed_chunk is mixed


# ---------------------------------------------------------------- every config field is wired

PROCESS_CONFIGS = (WorkerConfig, SchedulerConfig, TokenizerConfig)
# The fields no flag sets, and where each comes from instead. A new config field is either a
# flag (protocol/flags.py: ``flag(...)``) or goes on this list with its source.
FROM_ELSEWHERE = {
    (WorkerConfig, "model_path"): "the launcher: --model resolved to an HF directory",
    (WorkerConfig, "gguf_path"): "the launcher: the .gguf --model names (the embedded one by default)",
    (TokenizerConfig, "model_path"): "the launcher: --model resolved to an HF directory",
    (SchedulerConfig, "num_pages"): "the worker's WorkerReady: the KV pool it allocated",
    (SchedulerConfig, "context_len"): "the worker's WorkerReady: the model's context length",
    (SchedulerConfig, "page_size"): "the worker's WorkerReady: the page size it runs (--page-size)",
    (SchedulerConfig, "clip_max_new_tokens"): "a constant: SGLang's CLIP_MAX_NEW_TOKENS",
    (SchedulerConfig, "replica"): "the launcher: its data-parallel replica (--dp-size)",
    (WorkerConfig, "replica"): "the launcher: its data-parallel replica (--dp-size)",
    (WorkerConfig, "cpu_ids"): "the launcher: its replica's share of the cores (--dp-size)",
    (WorkerConfig, "tp_rank"): "the launcher: its tensor-parallel rank (--tp-size)",
    (WorkerConfig, "node_host"): "the launcher of a worker node: its address toward node 0",
    (SchedulerConfig, "worker_endpoints"): "the worker's WorkerReady: every tensor-parallel rank's socket",
    (SchedulerConfig, "speculative_row_cost"): "a constant: a token row's share of a step's fixed cost",
    (SchedulerConfig, "state_checkpoints"): "the worker's WorkerReady: its recurrent-state checkpoints",
}
# Probe values where default + 3 would break a field's own invariant (min <= max).
PROBE_VALUES = {"speculative_ngram_min_size": 3}
LAUNCHER_OWN_OPTIONS = {"model", "endpoint", "log_level", "help", "nnodes", "node_rank"}


def _probe(fl: Flag, name: str, default: Any, hint: Any) -> tuple[list[str], Any]:
    """A command line setting field ``name`` to a value other than its default, and that value."""
    spelling = fl.spelling(name)
    if hint is bool:
        if fl.negatable and default:
            return ["--no-" + spelling[2:]], False
        return [spelling], not default
    if fl.choices:
        value: Any = next(c for c in fl.choices if c != default)
    elif name in PROBE_VALUES:
        value = PROBE_VALUES[name]
    elif int in (hint, *typing.get_args(hint)):
        value = (default or 0) + 3
    elif float in (hint, *typing.get_args(hint)):
        value = default + 0.25
    else:
        value = f"probe-{name}"
    return [spelling, str(value)], value


def _probes() -> list[tuple[type, str, list[str], Any]]:
    out: list[tuple[type, str, list[str], Any]] = []
    for cls in PROCESS_CONFIGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fl = flag_of(f)
            if fl is not None:
                out.append((cls, f.name, *_probe(fl, f.name, f.default, hints[f.name])))
    return out


def _configs(argv: list[str]) -> dict[type, Any]:
    args = launcher.build_parser().parse_args(argv)
    return {
        WorkerConfig: launcher.worker_config(args, "/models/m"),
        SchedulerConfig: launcher.scheduler_config(args, _ready("cpu")),
        TokenizerConfig: launcher.tokenizer_config(args, "/models/m"),
    }


def test_every_config_field_is_a_flag_or_on_the_list_of_fields_set_elsewhere() -> None:
    assert set(launcher_flags.PROCESS_CONFIGS) == set(PROCESS_CONFIGS)
    not_flags = {
        (cls, f.name) for cls in PROCESS_CONFIGS for f in dataclasses.fields(cls) if flag_of(f) is None
    }
    assert not_flags == FROM_ELSEWHERE.keys(), "a config field is neither a launcher flag nor listed"
    for cls, name in not_flags:
        assert source_of(next(f for f in dataclasses.fields(cls) if f.name == name)), f"{name}: no source"


def test_every_option_sets_a_config_field() -> None:
    fields = {f.name for cls in PROCESS_CONFIGS for f in dataclasses.fields(cls)}
    dests = {action.dest for action in launcher.build_parser()._actions}
    assert dests - LAUNCHER_OWN_OPTIONS <= fields, "an option that no config field receives"


@pytest.mark.parametrize(("cls", "name", "argv", "value"), _probes(), ids=lambda v: getattr(v, "__name__", v))
def test_each_flag_arrives_in_every_config_with_its_field(
    cls: type, name: str, argv: list[str], value: Any
) -> None:
    configs = _configs(argv)
    assert getattr(configs[cls], name) == value, f"{' '.join(argv)} did not reach {cls.__name__}.{name}"
    for other, config in configs.items():  # a shared flag (--seed, --max-running-requests) feeds all
        if name in {f.name for f in dataclasses.fields(other)} and (other, name) not in FROM_ELSEWHERE:
            assert getattr(config, name) == value, f"{' '.join(argv)} did not reach {other.__name__}.{name}"
    defaults = _configs([])
    for other in PROCESS_CONFIGS:
        changed = {
            f.name
            for f in dataclasses.fields(other)
            if getattr(configs[other], f.name) != getattr(defaults[other], f.name)
        }
        assert changed <= {name}, f"{' '.join(argv)} also changed {other.__name__} {sorted(changed - {name})}"


def test_fields_set_elsewhere_arrive_from_the_worker_and_the_launcher() -> None:
    configs = _configs([])
    ready = _ready("cpu")
    assert configs[WorkerConfig].model_path == configs[TokenizerConfig].model_path == "/models/m"
    sched = configs[SchedulerConfig]
    assert (sched.num_pages, sched.context_len, sched.page_size) == (ready.num_pages, ready.context_len, 16)
    assert configs[TokenizerConfig].served_model_name == "SmolLM2-135M-Instruct", "named after --model"
    ranks = ["ipc:///run/to_worker.sock", "tcp://10.0.0.2:41000"]
    ready = msgspec.structs.replace(ready, rank_endpoints=ranks)
    args = launcher.build_parser().parse_args([])
    assert launcher.scheduler_config(args, ready).worker_endpoints == tuple(ranks)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--nnodes", "2", "--tp-size", "2"], "needs --dist-init-addr"),
        (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], "does not split"),
        (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2"], "expected 0 <= rank < nnodes"),
        (["--nnodes", "2", "--tp-size", "2", "--dp-size", "2", "--dist-init-addr", "h:1"], "not supported"),
        (["--dist-init-addr", "nohost"], "expected HOST:PORT"),
        (["--endpoint", "tcp://10.1.2.3:5555"], "binds loopback only"),
        (["--model", "/no/such/model"], "neither an HF model directory nor a .gguf file"),
        (["--model", str(Path(__file__))], "neither an HF model directory"),
        (["--model", "{tmp}/junk.gguf"], "junk.gguf is not a GGUF file"),
        (["--log-level", "LOUD"], "--log-level LOUD: Unknown level"),
        # The embedded SmolLM2: 9 attention heads, 3 KV heads.
        (
            ["--tp-size", "2"],
            r"--tp-size 2 does not divide the model's 9 attention heads and 3 KV heads .*1 or 3",
        ),
        # A CPU-only torch has no CUDA; a CUDA one has no device 99.
        (
            ["--device", "cuda:99"],
            r"--device cuda:99: (this torch .* without CUDA|no CUDA device|this machine has)",
        ),
        (["--device", "cuda", "--device-backend", "cpu"], "runs on the CPU, not --device cuda"),
        (["--dtype", "fp8"], "--dtype fp8: expected one of auto, float32"),
        (["--device-backend", "flash"], "expected one of auto, cpu, torch, triton"),
        (["--page-size", "0"], "page_size must be >= 1"),
        (["--max-prefill-tokens", "0"], "max_prefill_tokens must be >= 1"),  # the scheduler's
        (["--weight-dtype", "gguf", "--compile"], "--weight-dtype gguf: --compile"),
        (["--weight-dtype", "gguf", "--disable-cpu-kernels"], "--weight-dtype gguf: .*--disable-cpu-kernels"),
    ],
)
def test_what_flags_and_model_rule_out_is_refused_before_loading(
    argv: list[str], error: str, tmp_path: Path
) -> None:
    """One line on stderr and exit status 2, from the launcher alone: a child started (the worker
    loading the model) would log lines of its own, and its death exits 1."""
    (tmp_path / "junk.gguf").write_text("no GGUF magic here")
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--endpoint", endpoint, *(a.format(tmp=tmp_path) for a in argv)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("rivulet: ") and re.search(error, line), line


def test_the_old_spelling_of_a_renamed_flag_sets_the_same_field() -> None:
    parse = launcher.build_parser().parse_args
    old, new = parse(["--attention-backend", "torch"]), parse(["--device-backend", "torch"])
    assert launcher.worker_config(old, "/m") == launcher.worker_config(new, "/m")
    assert launcher.worker_config(old, "/m").device_backend == "torch"
    assert old.deprecated_spellings == (("--attention-backend", "--device-backend"),)
    assert new.deprecated_spellings == ()


def test_the_old_spelling_warns_in_one_line_at_start(tmp_path: Path) -> None:
    """The launcher names the new spelling before anything else, then judges the value as the new
    flag's (here a refusal, so that no engine starts)."""
    argv = ["--endpoint", f"ipc://{tmp_path}/client.sock", "--attention-backend", "flash"]
    done = subprocess.run([sys.executable, "launcher.py", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    warning, refusal = done.stderr.splitlines()
    assert re.search(r"--attention-backend is deprecated .*: use --device-backend", warning), warning
    assert refusal.startswith("rivulet: --device-backend flash: expected one of auto"), refusal


def test_node_flags_that_fit_pass() -> None:
    argv = ["--nnodes", "2", "--node-rank", "1", "--tp-size", "4", "--dist-init-addr", "127.0.0.1:29500"]
    launcher.check_nodes(launcher.build_parser().parse_args(argv))
    assert launcher.node_address("127.0.0.1:29500") == "127.0.0.1"


def test_docs_flags_md_is_the_parser() -> None:
    """docs/flags.md is generated from the parser; regenerate it with the command it names."""
    from launcher_flags import flags_markdown

    docs = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
    assert docs.read_text() == flags_markdown(), "run: python -m launcher_flags > docs/flags.md"


def test_the_dtypes_checked_at_start_are_the_workers() -> None:
    import launcher_checks
    from gpu_worker import model_runner

    assert set(launcher_checks.DTYPES) == {"auto", *model_runner._DTYPES}
