"""Write docs/BENCHMARKS.md and its PNGs from a sweep manifest (see sweep.py for its shape)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from bench import plots, report

LLAMA_CPP_RECIPE = """\
llama.cpp serves the same GGUF over the OpenAI API, so it is measured by the same code
(`bench/serving.py --backend openai`). `bench/llama_cpp.py` builds its C++ `llama-server` once per
CPU kind and caches it; llama.cpp is not a dependency of rivulet and no binary is committed:

```bash
python -m bench.llama_cpp build --kind avx2      # avx2 | avx512 | avx512_bf16 | native; ~6-12 min on 2 cores
python -m bench.llama_cpp path --kind avx2       # prints the cached binary; exit 1 if there is none
```

`build` runs `pip download --no-deps --no-binary :all: llama-cpp-python` (the PyPI sdist), extracts it and
builds only the `llama-server` target of its `vendor/llama.cpp` (cmake, Release, static, `-DLLAMA_CURL=OFF`,
no tests or examples) into `~/.cache/rivulet/llama.cpp/<kind>/llama-server` (`$RIVULET_CACHE_DIR` moves
the cache root, as for converted models). A binary already there is not rebuilt unless `--force`.
The kinds switch the instruction set explicitly, with `GGML_NATIVE=OFF`: `avx2` has AVX, AVX2, FMA, F16C
and BMI2 on and AVX-512 off; `avx512` adds AVX512 (AVX512_BF16 off); `avx512_bf16` adds AVX512_BF16 and
AVX512_VNNI; `native` is `GGML_NATIVE=ON` (this machine's compiler flags).

`python -m bench.targets --peer-llama-cpp auto` measures it beside rivulet (next section). In a sweep it is
a peer like any OpenAI server:

```bash
GGUF=$(python -c "from gpu_worker.weights.model_files import embedded_gguf_path as p; print(p())")
LLAMA_SERVER=$(python -m bench.llama_cpp path --kind avx2)
python -m bench.sweep --sweeps concurrency \\
  --peer "llama.cpp=$LLAMA_SERVER -m $GGUF --port {port} -np 32 -c 8192 -t $(nproc)"
```

`{port}` is filled with a free port; the sweep waits for `GET /v1/models` and stops the server by pid."""

TARGETS_HOWTO = """\
## Issue 7's targets: `bench/targets.py`

Numbers from: each run pasted below names its commit and CPU (bench/targets.py prints the CPU line).

One command measures every target of issue 7 and prints the markdown table its note quotes
(CPU-heavy: run it under the shared lock so no other benchmark overlaps it):

```bash
flock /tmp/rivulet-cpu.lock python -m bench.targets                # the engine's default dtype, 3 rounds
flock /tmp/rivulet-cpu.lock python -m bench.targets --dtype float32,bfloat16
```

Each round starts a fresh engine per dtype (`launcher.py --dtype D --http-port P`, plus
`--engine-flags`) and measures on it, in this order:

- start-up: from starting the launcher to its `rivulet ready:` line (the GGUF is converted
  beforehand, so the weight cache is warm);
- 32 streams: 64 random requests (32-token prompts, 64 new tokens, EOS ignored) at
  `--max-concurrency 32` after 2 warm-up requests: output tok/s and TTFT p50;
- worker busy share: d `rivulet_worker_busy_seconds_total` / d `rivulet_worker_clock_seconds`
  (the worker's own clock), polled from `GET /metrics` during the 32-stream run, from the moment
  all 32 streams have their first token to the first finish (steady decode);
- 1 stream: 4 requests one at a time: decode tok/s = 1 / TPOT p50, and output tok/s;
- idle CPU: utime + stime of the launcher and every descendant (`/proc`) over 10 s once the
  engine has served those requests, as % of one core;
- offline: `bench/offline.py` with 256 prompts on that engine, then HF `generate` of the same
  dtype in the benchmark's process (the faster of static batch 32 and 64): the ratio.

Round r measures every dtype before round r + 1; a cell is the median over rounds with (min-max).
The JSON record is appended to `bench/results/targets.jsonl`. The anchor columns are the issue's
numbers from a 2-vCPU AMD Zen 5, not measured on this machine.

llama.cpp beside rivulet (`bench/llama_cpp.py` builds it, see Peers above):

```bash
flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp auto   # the kind rivulet acts as
flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp /path/to/llama-server
RIVULET_CPU_KIND=avx2 python -m bench.targets --peer-llama-cpp auto         # both as AVX2-only CPUs
```

With a peer, each rivulet round also runs the 32-stream and 1-stream workloads over rivulet's HTTP API
(`POST /v1/completions`, `bench/serving.py --backend openai`), then starts
`llama-server -m <the embedded GGUF> --port P -np 32 -c 8192 -t <cores>` and runs the same workloads with
the same prompts through the same code, then stops it (rivulet round, llama.cpp round, ...). The table
gains rivulet's and llama.cpp's HTTP numbers and the ratios rivulet / llama.cpp of 32-stream output tok/s
and 1-stream decode tok/s (a cell: the median of the per-round ratios); the other rows stay rivulet over
ZMQ. `auto` takes `~/.cache/rivulet/llama.cpp/<kind>/llama-server` of the CPU kind rivulet acts as
(`RIVULET_CPU_KIND`, or the native kind; then a `native` build also does) and says how to build it if
there is none; a PATH is taken as given, with a warning when rivulet emulates a lesser kind and PATH is
not that kind's build. The table's first line is the CPU kind acted as and the CPU's flags
(`gpu_worker/backends/cpu/kind.py` `describe`); the record keeps them under `machine`, and
llama.cpp's own rounds under `metrics.peer`."""


# Everything after this line is pasted from the other benches' output, each section naming its
# commit and CPU; write_docs keeps it as it is.
BY_HAND = "<!-- The sections below come from the commands they name; bench/sweep.py keeps them. -->\n"


def _machine_lines(m: dict[str, Any]) -> list[str]:
    mach = m["machine"]
    gpu = f", GPU {mach['gpu']}" if mach.get("gpu") else ", no GPU"
    return [
        f"- Date: {m['time']}; commit `{m['git_commit']}`",
        f"- Machine: {mach['cpu']}, {mach['cores']} cores, {mach['mem_gib']} GiB RAM{gpu}; "
        f"Python {mach['python']}, torch {mach['torch']}",
        f"- CPU features: {mach.get('cpu_features', 'not recorded')}",
        f"- Model: {m['model']}; rivulet engines: `{shlex.join(['launcher.py', *m['engine_flags']])}` plus "
        "each configuration's flags",
        f"- Repeats: {m['repeats']} per configuration, interleaved (A B A B ...); a cell is the median "
        "over repeats with (min-max)",
        f"- Note: {m['note']}",
    ]


def provenance(m: dict[str, Any]) -> str:
    """The line under every ``##`` section: which commit and CPU its numbers came from."""
    mach = m["machine"]
    features = mach.get("cpu_features", "").partition("; ")[0]  # "cpu kind avx2"
    kind = f", {features}" if features else ""
    return f"Numbers from: commit `{m['git_commit'][:12]}`, CPU {mach['cpu']} ({mach['cores']} cores{kind})."


def _pair_section(sweep: dict[str, Any], out_dir: Path) -> list[str]:
    lines = [f"### {sweep['title']}", "", f"Seeds: {sweep['expect']}.", ""]
    if sweep.get("note"):
        lines += [f"Note: {sweep['note']}", ""]
    workload = sweep["variants"][0]["workload"]
    lines += [f"Workload: `python -m bench.serving {shlex.join(workload)}`", ""]
    for v in sweep["variants"]:
        flags = shlex.join(v["engine_flags"]) or "(defaults)"
        lines.append(f"- {v['label']}: `launcher.py {flags}`")
    lines += ["", report.pair_table(sweep), ""]
    lines += [f"- {d}" for d in report.deltas(sweep)]
    png = f"bench_{sweep['name']}.png"
    if plots.plot_cdfs(sweep, out_dir / png):
        lines += ["", f"![{sweep['title']}: TTFT and ITL CDFs]({png})"]
    return [*lines, ""]


def _concurrency_section(sweep: dict[str, Any], out_dir: Path, source: str) -> list[str]:
    v0 = sweep["variants"][0]
    lines = [
        f"## {sweep['title'][0].upper()}{sweep['title'][1:]}", "", source, "",
        "Closed loop: at most N requests in flight, each ended request replaced by the next "
        "(max(4, 2N) requests per run below N = 16, 1.5N from there).", "",
        f"Workload at N = {v0['concurrency']}: `python -m bench.serving {shlex.join(v0['workload'])}`", "",
        f"Anchors: {sweep['expect']}.", "",
        report.concurrency_table(sweep), "",
    ]  # fmt: skip
    if plots.plot_concurrency(sweep, out_dir / "bench_concurrency.png"):
        lines += ["![throughput and TTFT p99 vs concurrency](bench_concurrency.png)", ""]
    return lines


def write_docs(manifest: dict[str, Any], out_dir: Path) -> Path:
    """Write BENCHMARKS.md (and PNGs next to it) into ``out_dir``; returns the markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Benchmarks", "",
        "Written by `bench/sweep.py` from one run, and after its marker from the commands of "
        "`bench/tables.sh`; regenerate rather than edit. "
        f"Command: `{manifest['command']}`", "",
        *_machine_lines(manifest), "",
    ]  # fmt: skip
    source = provenance(manifest)
    if manifest.get("offline"):
        lines += ["## Offline throughput: rivulet vs HF transformers generate", "", source, ""]
        lines += [report.offline_table(manifest["offline"]), ""]
    pairs = [s for s in manifest["sweeps"] if s["kind"] == "pair"]
    if pairs:
        lines += ["## The seeds' pairs", "", source, ""]
        for sweep in pairs:
            lines += _pair_section(sweep, out_dir)
    for sweep in manifest["sweeps"]:
        if sweep["kind"] == "concurrency":
            lines += _concurrency_section(sweep, out_dir, source)
    peers = manifest.get("peers") or []
    ran = f"Peers in this run: {', '.join(peers)}." if peers else "No peer ran in this sweep."
    if manifest.get("peer_note"):
        ran += " " + manifest["peer_note"]
    lines += ["## Peers", "", source, "", ran, "", LLAMA_CPP_RECIPE, "", TARGETS_HOWTO, ""]
    path = out_dir / "BENCHMARKS.md"
    kept = path.read_text().partition(BY_HAND)[2] if path.exists() else ""
    path.write_text("\n".join(lines) + "\n" + BY_HAND + (kept or "\n"))
    return path
