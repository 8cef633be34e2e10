"""Offline throughput: N prompts submitted at once, input and output tokens/s end to end.

    python -m bench.offline --num-prompts 64 --input-len 32 --output-len 32 --baseline hf

What runs is bench/lib/offline.py's: its own engine unless --endpoint, and with ``--baseline hf``
HF transformers ``generate`` on the same prompts, interleaved; prints the ratio rivulet/HF.
"""

from __future__ import annotations

import sys

from bench.lib.offline import build_parser, format_result, run_offline
from bench.lib.records import append_record, make_record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run_offline(args)
    print(format_result(res))
    if not args.no_record:
        metrics = {k: v for k, v in vars(res).items() if k != "config"} | {"ratio": res.ratio}
        append_record(args.result_file, make_record("offline", res.config, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
