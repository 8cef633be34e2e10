"""The launcher's command line, derived from the process configs, and the configs built from it.

Each ``flag(...)`` field of WorkerConfig, SchedulerConfig and TokenizerConfig is one
option here: spelling, help, default, type and choices all come from the field
(protocol/flags.py), and its parsed value goes to that field under the field's name.
A field two configs share (``--seed``, ``--max-running-requests``) is one option
feeding both. ``given(...)`` fields are not options: the launcher passes them in.
So adding an option is adding a field, in one place. A renamed flag keeps its old spelling for
a release (``DEPRECATED_SPELLINGS``): the same effect, and one warning line at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from client import DEFAULT_ENDPOINT
from gpu_worker.config import WorkerConfig
from protocol import WorkerReady
from protocol.flags import Flag, flag_of, source_of
from scheduler_proc.config import SchedulerConfig
from tokenizer_proc.config import TokenizerConfig

logger = logging.getLogger("rivulet.launcher")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the HTTP model id when --model is not given
# The configs whose flag fields make up the command line, in --help order.
PROCESS_CONFIGS: tuple[type, ...] = (SchedulerConfig, WorkerConfig, TokenizerConfig)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# A renamed flag's old spelling, accepted for one release: config field -> the old spelling.
# --attention-backend chose the whole device backend (matmuls, GGUF kernels, threads), not only
# attention, which is what vLLM's and SGLang's flag of that name choose.
DEPRECATED_SPELLINGS = {"device_backend": "--attention-backend"}

C = TypeVar("C")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own options, then one option per flag field of the process configs."""
    p = argparse.ArgumentParser(description="rivulet: a multi-process LLM serving engine")
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--endpoint", default=DEFAULT_ENDPOINT, help="client socket: ipc://PATH or tcp://127.0.0.1:PORT"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        help="Python logging level of the launcher and every process it starts: "
        "DEBUG, INFO, WARNING or ERROR",
    )
    p.add_argument("--nnodes", type=int, default=1, help="machines the tensor-parallel ranks spread over")
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index: 0 runs the tokenizer, the scheduler and the first ranks; others "
        "run only their ranks (same --model, --tp-size, --nnodes and --dist-init-addr on all)",
    )
    added: dict[str, tuple[str, Any]] = {}  # dest -> (spelling, default) of options already added
    for cls in PROCESS_CONFIGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fl = flag_of(f)
            if fl is None:
                continue
            spelling = fl.spelling(f.name)
            if f.name in added:  # a field two configs share: one option feeds both
                assert added[f.name] == (spelling, f.default), f"{cls.__name__}.{f.name}: flags disagree"
                continue
            added[f.name] = (spelling, f.default)
            _add_option(p, f.name, fl, f.default, hints[f.name])
            if f.name in DEPRECATED_SPELLINGS:
                _add_deprecated_spelling(p, f.name, spelling, f.default)
    p.set_defaults(deprecated_spellings=())
    return p


def _add_option(p: argparse.ArgumentParser, dest: str, fl: Flag, default: Any, hint: Any) -> None:
    unset = default if fl.unset_default is ... else fl.unset_default
    spelling = fl.spelling(dest)
    if hint is bool:
        if fl.negatable:
            action: Any = argparse.BooleanOptionalAction
        else:
            assert not default or fl.name, f"{dest}: a switch on by default needs a --disable-... name"
            action = "store_false" if default else "store_true"
        p.add_argument(spelling, dest=dest, action=action, default=unset, help=fl.help)
        return
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    p.add_argument(spelling, dest=dest, type=kind, default=unset, choices=fl.choices, help=fl.help)


class _DeprecatedSpelling(argparse.Action):
    """A renamed flag's old spelling: sets the same field, and notes the (old, new) spellings in
    ``args.deprecated_spellings`` for ``warn_deprecated`` (logging is set up after parsing)."""

    def __init__(self, *args: Any, new_spelling: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new_spelling = new_spelling

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.deprecated_spellings = (*namespace.deprecated_spellings, (option_string, self.new_spelling))


def _add_deprecated_spelling(p: argparse.ArgumentParser, dest: str, spelling: str, default: Any) -> None:
    old = DEPRECATED_SPELLINGS[dest]
    what = f"deprecated spelling of {spelling}, accepted for one release: the same effect"
    p.add_argument(
        old, dest=dest, action=_DeprecatedSpelling, new_spelling=spelling, default=default, help=what
    )


def warn_deprecated(args: argparse.Namespace) -> None:
    """One warning line per old spelling on the command line (the launcher calls it at start)."""
    for old, new in args.deprecated_spellings:
        logger.warning("%s is deprecated and goes in the next release: use %s (the same effect)", old, new)


def config_from_args(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """``cls`` with every flag field from ``args`` and the ``given`` fields passed in.

    ``given`` names fields no flag sets, and must name each flag whose ``unset_default``
    is None: its value when that flag is not on the command line. A given field not
    passed keeps its default.
    """
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        fl, source = flag_of(f), source_of(f)
        assert (fl is None) != (source is None), f"{cls.__name__}.{f.name}: a flag or given, not both"
        if fl is not None:
            value = getattr(args, f.name)
            if fl.unset_default is None:  # the launcher's value stands in for an unset flag
                fallback = given.pop(f.name)
                value = fallback if value is None else value
            values[f.name] = value
        elif f.name in given:
            values[f.name] = given.pop(f.name)
    assert not given, f"{cls.__name__}: no such given fields {sorted(given)}"
    return cls(**values)


def tokenizer_config(args: argparse.Namespace, model_path: str) -> TokenizerConfig:
    if args.http_host not in LOOPBACK_HOSTS and args.http_port is not None:
        logger.warning("--host %s: the HTTP API is reachable from other machines", args.http_host)
    name = Path(args.model or EMBEDDED_MODEL_NAME).name.removesuffix(".gguf")
    return config_from_args(TokenizerConfig, args, model_path=model_path, served_model_name=name)


def worker_config(
    args: argparse.Namespace,
    model_path: str,
    gguf_path: str = "",
    replica: int = 0,
    cpu_ids: tuple[int, ...] = (),
    tp_rank: int = 0,
    dist_init_addr: str = "",
    node_host: str = "",
) -> WorkerConfig:
    return config_from_args(
        WorkerConfig, args, model_path=model_path, gguf_path=gguf_path, replica=replica, cpu_ids=cpu_ids,
        tp_rank=tp_rank, dist_init_addr=dist_init_addr, node_host=node_host,
    )  # fmt: skip


def scheduler_config(args: argparse.Namespace, ready: WorkerReady, replica: int = 0) -> SchedulerConfig:
    """--enable-mixed-chunk / --no-enable-mixed-chunk, else on where the worker runs on CPU."""
    return config_from_args(
        SchedulerConfig,
        args,
        num_pages=ready.num_pages,
        context_len=ready.context_len,
        page_size=ready.page_size,
        enable_mixed_chunk=ready.device.startswith("cpu"),
        replica=replica,
        worker_endpoints=tuple(ready.rank_endpoints),
        state_checkpoints=ready.state_checkpoints,
    )


def replica_cpus(dp_size: int, cores: list[int] | None = None) -> list[tuple[int, ...]]:
    """Each data-parallel replica's cores: an equal share of the launcher's (``cores``, default its
    affinity), in order; () for one replica (its worker uses them all, unpinned). With more replicas
    than cores, replicas share cores round-robin."""
    if dp_size == 1:
        return [()]
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if dp_size > len(cores):
        logger.warning("%d worker processes > %d cores: they share cores", dp_size, len(cores))
        return [(cores[i % len(cores)],) for i in range(dp_size)]
    share = len(cores) // dp_size
    return [tuple(cores[i * share : (i + 1) * share]) for i in range(dp_size)]


def check_endpoint(endpoint: str) -> str:
    """The client socket stays on this machine: an ipc:// path or a loopback tcp:// address."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host in LOOPBACK_HOSTS or host.startswith("127."):
            return endpoint
        raise SystemExit(f"--endpoint {endpoint}: rivulet binds loopback only (127.0.0.1), not {host}")
    raise SystemExit(f"--endpoint {endpoint}: expected ipc://PATH or tcp://127.0.0.1:PORT")


def check_nodes(args: argparse.Namespace) -> None:
    """--nnodes / --node-rank / --dist-init-addr / --tp-size / --dp-size that fit together, else exit."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"--node-rank {args.node_rank} --nnodes {args.nnodes}: expected 0 <= rank < nnodes")
    if args.tp_size < 1 or args.dp_size < 1:
        raise SystemExit("--tp-size and --dp-size must be >= 1")
    if args.nnodes > 1 and args.dp_size > 1:
        raise SystemExit("--dp-size > 1 with --nnodes > 1 is not supported: run a server per node group")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"--dist-init-addr {args.dist_init_addr}: expected HOST:PORT")
    if args.nnodes == 1:
        return
    if args.tp_size % args.nnodes:
        raise SystemExit(f"--tp-size {args.tp_size} does not split over --nnodes {args.nnodes}")
    if args.dist_init_addr is None:
        raise SystemExit("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address), the same on all")


def node_address(dist_init_addr: str) -> str:
    """This machine's address on the route to node 0 (where its ranks take batches from)."""
    host, _, port = dist_init_addr.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((host.strip("[]"), int(port)))
        return str(s.getsockname()[0])


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every launcher option with its default and help, from the parser itself."""
    parser = parser or build_parser()
    lines = [
        "# Launcher flags",
        "",
        "Generated from the launcher's parser by `python -m launcher_flags > docs/flags.md`;",
        "`tests/test_launcher_flags.py` fails when this file and the parser disagree.",
        "",
        "A switch's default is what you get without it: `off` means not given (without",
        "`--disable-overlap-schedule` the overlap schedule runs). A flag with a `--no-` form takes",
        "either spelling; an empty default is stated in the help (or there is none).",
        "",
        "| flag | default | what |",
        "|---|---|---|",
    ]
    for action in parser._actions:  # argparse lists its options only here
        if action.option_strings and action.help != argparse.SUPPRESS:
            lines.append(flag_row(action))
    return "\n".join(lines) + "\n"


def flag_row(action: argparse.Action) -> str:
    """One option's row: every spelling, the default a user gets without it, the help and choices."""
    spellings = " / ".join(f"`{s}`" for s in action.option_strings)
    what = " ".join((action.help or "").split())
    if action.choices is not None:
        what += "; choices: " + ", ".join(f"`{c}`" for c in action.choices)
    return f"| {spellings} | {default_cell(action)} | {what.replace('|', chr(92) + '|')} |"


def default_cell(action: argparse.Action) -> str:
    """What the user gets without the option, in the words a reader of the flag expects."""
    if action.default in (None, argparse.SUPPRESS):
        return ""  # decided at start (its help says how) or there is no value
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0 and isinstance(action.const, bool):
        # store_true / store_false: the parser default is the opposite of what the switch stores,
        # so printing it would read `True` for --disable-...; the switch itself is off.
        assert action.default is not action.const, f"{action.dest}: a switch that changes nothing"
        return "off"
    return f"`{action.default}`"


if __name__ == "__main__":
    print(flags_markdown(), end="")
