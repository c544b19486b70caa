"""One vLLM start and greedy generation, run with the vLLM venv's Python by vllm_e2e.py.

Usage: vllm_run.py JSON, where JSON holds ``model`` (a directory), ``prompt``, and optionally
``trust_remote_code``, ``load_format`` and ``safetensors_load_strategy``. Prints one JSON line:
the generated token ids and text, and the seconds vLLM took to start (``LLM(...)``).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    args = json.loads(sys.argv[1])
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    extra = {}
    if args.get("safetensors_load_strategy"):
        extra["safetensors_load_strategy"] = args["safetensors_load_strategy"]
    llm = LLM(
        model=args["model"],
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        trust_remote_code=bool(args.get("trust_remote_code")),
        load_format=args.get("load_format", "auto"),
        seed=0,
        **extra,
    )
    ready = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([args["prompt"]], params, use_tqdm=False)[0].outputs[0]
    result = {
        "tokens": list(out.token_ids),
        "text": out.text,
        "import_s": imported - started,
        "startup_s": ready - imported,
    }
    print("VLLM_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
