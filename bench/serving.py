"""Online streaming benchmark: roseinfer's benchmark_streaming, against rivulet or any OpenAI server.

    python launcher.py &        # wait for "rivulet ready"
    python -m bench.serving --prompt Hello --prompt-repeats "512,1,1,1" --unique-prompts \\
        --num-requests 64 --max-new-tokens 32 --no-stop-on-eos
    python -m bench.serving --backend openai --base-url http://127.0.0.1:8080 \\
        --workload random --input-len 32 --output-len 32 --max-concurrency 16

Every request streams; TTFT, ITL, TPOT and latency are taken at the client as each chunk arrives
(bench/lib/serving.py, bench/lib/metrics.py). Prints benchmark_streaming's block and appends one JSON record
per run to --result-file.
"""

from __future__ import annotations

import asyncio
import sys

from bench.lib.metrics import format_block, samples_ms
from bench.lib.records import append_record, make_record
from bench.lib.serving import benchmark, build_parser, run_config
from client import default_endpoint


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summary, results = asyncio.run(benchmark(args))
    target = args.endpoint or default_endpoint() if args.backend == "zmq" else args.base_url
    header = {"Backend": f"{args.backend} ({target})", "Workload": args.workload}
    if args.label:
        header["Label"] = args.label
    print(format_block(summary, header), flush=True)
    errors = sorted({r.error for r in results if r.error})
    for err in errors[:5]:
        print(f"error: {err}", file=sys.stderr)
    if not args.no_record:
        append_record(
            args.result_file, make_record("serving", run_config(args), summary, samples_ms(results))
        )
    return 1 if summary.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
