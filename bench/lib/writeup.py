"""Write docs/benchmarks.md and its PNGs from a sweep manifest (see bench/sweep.py for its shape)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from bench.lib import plots, report

LLAMA_CPP_RECIPE = """\
llama.cpp serves the same GGUF over the OpenAI API, so it is measured by the same code
(`python -m bench.serving --backend openai`). `python -m bench.llama_cpp` builds its C++
`llama-server` once per CPU kind and caches it; llama.cpp is not a dependency of rivulet and no
binary is committed:

<!-- docs-test: parse-only (builds llama.cpp, minutes) -->
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

<!-- docs-test: parse-only (a full sweep) -->
```bash
GGUF=$(python -c "from gpu_worker.weights.model_files import embedded_gguf_path as p; print(p())")
LLAMA_SERVER=$(python -m bench.llama_cpp path --kind avx2)
python -m bench.sweep --sweeps concurrency \\
  --peer "llama.cpp=$LLAMA_SERVER -m $GGUF --port {port} -np 32 -c 8192 -t $(nproc)"
```

`{port}` is filled with a free port; the sweep waits for `GET /v1/models` and stops the server by pid."""

TARGETS_HOWTO = """\
## Serving targets: throughput, latency, busy share, idle cost, start-up (`bench/targets.py`)

Numbers from: each run pasted below names its commit and CPU (`python -m bench.targets` prints the CPU line).

One command measures every serving target and prints its markdown table
(CPU-heavy: run it under the shared lock so no other benchmark overlaps it):

<!-- docs-test: parse-only (minutes) -->
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
- offline: `python -m bench.offline` with 256 prompts on that engine, then HF `generate` of the same
  dtype in the benchmark's process (the faster of static batch 32 and 64): the ratio.

Round r measures every dtype before round r + 1; a cell is the median over rounds with (min-max).
The JSON record is appended to `bench/results/targets.jsonl`. The anchor columns are reference
numbers from a 2-vCPU AMD Zen 5, not measured on this machine.

llama.cpp beside rivulet (`python -m bench.llama_cpp build` builds it, see Peers above):

<!-- docs-test: parse-only (minutes) -->
```bash
flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp auto   # the kind rivulet acts as
flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp /path/to/llama-server
RIVULET_CPU_KIND=avx2 python -m bench.targets --peer-llama-cpp auto         # both as AVX2-only CPUs
```

With a peer, each rivulet round also runs the 32-stream and 1-stream workloads over rivulet's HTTP API
(`POST /v1/completions`, `python -m bench.serving --backend openai`), then starts
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


HOW_TO_RUN = """\
`bench/` measures rivulet the way roseinfer's `benchmark_streaming` does (TTFT, TPOT, ITL and
latency taken at the client as each chunk arrives) and compares configurations and peers in one run.
Against a running engine (`python launcher.py --http-port 8000`; the OpenAI backend takes any
OpenAI-compatible server):

<!-- docs-test: smoke --num-requests 2 --max-new-tokens 4 --output-len 4 --no-record --no-progress -->
```bash
pip install -e ".[bench]"
python -m bench.serving --prompt Hello --prompt-repeats "512,1,1,1" --unique-prompts \\
    --num-requests 64 --max-new-tokens 32 --no-stop-on-eos
python -m bench.serving --backend openai --base-url http://127.0.0.1:8000 \\
    --workload random --input-len 32 --output-len 32 --max-concurrency 16
```

Benchmarks that start their own engines or run the worker alone (minutes each; `bench/tables.sh`
runs every table of this file from one commit):

<!-- docs-test: parse-only (minutes each) -->
```bash
python -m bench.offline --baseline hf      # 64 prompts at once, rivulet vs HF generate
python -m bench.sweep                      # the scheduling pairs + concurrency + offline, ~20 min
python -m bench.sweep --quick              # the same with tiny workloads
python -m bench.targets                    # the serving targets (below)
python -m bench.logprobs_cost              # a 32-stream decode step: no logprobs vs top_logprobs=20
python -m bench.penalty_cost               # 32 streams with penalties on every request vs without
python -m bench.penalty_step               # the worker's 32-row decode step with and without them
python -m bench.grammar_cost               # 32 streams with a JSON schema each vs without; schema TTFT
python -m bench.choices                    # n = 8 against n = 1 on a 512-token prompt
python -m bench.dp_routing --part routing  # data-parallel routing policies
python -m bench.tp_step                    # tensor-parallel step time, shm vs gloo all-reduce
python -m bench.matmul_paths               # each bf16 matmul path per row count, and the plan it gives
python -m bench.quant_matmul               # the GGUF block kernels per type and row count
python -m bench.weight_memory              # the worker's weight bytes per --weight-dtype
python -m bench.long_context --peer-llama-cpp auto   # 1 stream at 32-2048-token prompts vs llama-server
python -m bench.decode_attention           # the C decode attention alone, by context and row count
python -m bench.worker_step                # the model runner's step alone, per batch shape and dtype
python -m bench.policy_ab                  # the scheduling knobs A/B, and recovery after retraction
python -m bench.speculative                # n-gram speculative decoding against none, per workload
python -m bench.startup                    # launcher to Ready, first start and warm, and bytes written
python -m bench.gguf_models                # the bigger bench GGUFs (llama1b-*, qwen3moe30b-*)
```

`bench.sweep` starts its own engines (one per configuration, always stopped), runs the
configurations interleaved (A B A B A B), reports medians with their spread, and rewrites this
file's first half and its PNGs. Each run is also appended as a JSON record (config, machine, git
commit, numbers) under `bench/results/`."""

PAIRS_TITLE = "Scheduling A/B pairs: admission, decode-first, request cap, chunking, prefix cache"

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
    lines = [f"### {sweep['title']}", "", f"Reference: {sweep['expect']}.", ""]
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
    """Write benchmarks.md (and PNGs next to it) into ``out_dir``; returns the markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Benchmarks", "",
        "Written by `python -m bench.sweep` from one run, and after its marker from the commands of "
        "`bench/tables.sh`; regenerate rather than edit. "
        f"Command: `{manifest['command']}`", "",
        *_machine_lines(manifest), "",
        HOW_TO_RUN, "",
    ]  # fmt: skip
    source = provenance(manifest)
    if manifest.get("offline"):
        lines += ["## Offline throughput: rivulet vs HF transformers generate", "", source, ""]
        lines += [report.offline_table(manifest["offline"]), ""]
    pairs = [s for s in manifest["sweeps"] if s["kind"] == "pair"]
    if pairs:
        lines += [f"## {PAIRS_TITLE}", "", source, ""]
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
    path = out_dir / "benchmarks.md"
    kept = path.read_text().partition(BY_HAND)[2] if path.exists() else ""
    path.write_text("\n".join(lines) + "\n" + BY_HAND + (kept or "\n"))
    return path
