"""`specgen bench --concurrency 1,2,4,8`: a running HTTP server driven by N concurrent
streaming clients, per method: aggregate throughput, time to first token and time per output
token (p50 and p95 over the requests), speculative against plain at the same concurrency.

Knows nothing about how the server was started: it is given the server's URL, key and model
id (cli/bench.py starts one on the loaded pair). Stdlib HTTP only.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import replace
from urllib.parse import urlsplit

from rich.markup import escape
from rich.table import Table

from specgen.bench.methods import variant
from specgen.bench.throughput import Cell, Width
from specgen.config import Method
from specgen.decoding.stats import Stats, rate
from specgen.errors import ConfigError


def speculative(name: str) -> dict:
    """A bench method name (`plain`, `chain`, `chain/k2`, ...) as the request's `speculative` field."""
    methods = {m.value: m for m in Method}
    if name in methods:
        return {"method": name}
    found = variant(name)
    if found is None:
        raise ConfigError(f"--concurrency measures specgen's own methods; '{name}' is not one")
    method, overrides = found
    out = {"method": method.value}
    if "draft_tokens" in overrides:
        out.update(
            draft_tokens=overrides["draft_tokens"], draft_confidence=overrides.get("draft_confidence", 0.0)
        )
    elif "draft_confidence" in overrides:
        out["draft_confidence"] = overrides["draft_confidence"]
    if "schedule" in overrides:
        out["draft_schedule"] = overrides["schedule"].value
    return out


def one_request(url: str, key: str, body: dict) -> Stats:
    """One streamed request as its client saw it: a Stats of its tokens (the usage chunk's),
    its time to the first text and to the last chunk, and its drafts (the `speculative` summary;
    a request whose summary never came covers no generation's counts)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    started = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = last = None
    seen = Stats(method=body["speculative"]["method"], generations=0)
    for line in response:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        now = time.perf_counter()
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = first or now
            last = now
        if "usage" in chunk and chunk["usage"]:
            summary = chunk.get("speculative") or {}
            seen = replace(
                seen,
                new_tokens=chunk["usage"]["completion_tokens"],
                generations=int(bool(summary)),
                drafted=summary.get("drafted", 0),
                accepted=summary.get("accepted", 0),
            )
    conn.close()
    end = time.perf_counter()
    return replace(seen, time_to_first_token=(first or end) - started, seconds=(last or end) - started)


GREEDY = {"temperature": 0}


def measure_cell(
    url: str,
    key: str,
    model: str,
    prompts: list[list[dict]],
    name: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    sampling: dict = GREEDY,
) -> Cell:
    """`clients` threads, each sending `per_client` streaming requests one after another."""
    return summarize(
        name,
        clients,
        [drive(url, key, model, prompts, name, clients, per_client, max_tokens, sampling=sampling)],
    )


def drive(
    url: str,
    key: str,
    model: str,
    prompts: list[list[dict]],
    name: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    stop: threading.Event | None = None,
    sampling: dict = GREEDY,
) -> Cell:
    """One run of a cell: `clients` threads, each sending `per_client` streamed requests in turn; they send no
    more
    once `stop` is set (Ctrl-C). `sampling`: each request's temperature, top_p, top_k and seed
    (a seed is offset by the request's number, so requests differ but every method sees the same)."""
    timings: list[Stats] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        for i in range(per_client):
            if stop is not None and stop.is_set():
                return
            messages = prompts[(number * per_client + i) % len(prompts)]
            laws = dict(sampling)
            if laws.get("seed") is not None:
                laws["seed"] += number * per_client + i
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                **laws,
                "stream": True,
                "stream_options": {"include_usage": True},
                "speculative": speculative(name),
            }
            try:
                timing = one_request(url, key, body)
            except Exception as exc:  # noqa: BLE001 - a failed request is reported in the cell
                with lock:
                    errors.append(str(exc)[:200])
                continue
            with lock:
                timings.append(timing)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return _cell(name, clients, timings, errors, time.perf_counter() - started)


def summarize(name: str, clients: int, runs: list[Cell]) -> Cell:
    """A cell from its runs pooled: tokens over seconds of all runs, quantiles over all requests,
    and each run's tok/s."""
    cell = _cell(
        name,
        clients,
        [t for run in runs for t in run.timings],
        [e for run in runs for e in run.errors],
        sum(run.seconds for run in runs),
    )
    cell.runs = [run.tokens_per_second for run in runs]
    return cell


def _cell(name: str, clients: int, timings: list[Stats], errors: list[str], seconds: float) -> Cell:
    """The cell of these requests (each one's Stats as its client saw it) and `seconds` of wall time."""
    tokens = sum(t.new_tokens for t in timings)
    ttfts = [t.time_to_first_token for t in timings] or [0.0]
    tpots = [
        rate(t.seconds - t.time_to_first_token, t.new_tokens - 1) for t in timings if t.new_tokens > 1
    ] or [0.0]
    # pooled over the requests the server summarized, as the per-prompt bench pools: none where nothing
    # was drafted
    drafted = sum(t.drafted for t in timings if t.generations)
    accepted = sum(t.accepted for t in timings if t.generations)
    return Cell(
        name,
        Width.CLIENTS,
        clients,
        len(timings),
        tokens,
        seconds,
        rate(tokens, seconds) or 0.0,
        drafted=drafted,
        accepted=accepted,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p95=_quantile(ttfts, 0.95),
        tpot_p50=_quantile(tpots, 0.5),
        tpot_p95=_quantile(tpots, 0.95),
        errors=errors,
        timings=timings,
    )


def run_concurrency(
    url: str,
    key: str,
    model: str,
    prompts: list[list[dict]],
    methods: list[str],
    levels: list[int],
    per_client: int,
    max_tokens: int,
    on_cell=None,
    repeats: int = 1,
    sampling: dict = GREEDY,
) -> tuple[list[Cell], bool]:
    """Every method at every concurrency after one warm-up request per method. Each level runs
    its methods `repeats` times, every other time in reverse order (plain, chain, chain, plain,
    ...), so drift in the machine's speed hits every method alike; a cell pools its runs.
    Returns the cells and whether Ctrl-C stopped the run: the level it stopped in keeps a cell
    per method from the runs that finished (its `runs` says how many)."""
    cells, stop, interrupted = [], threading.Event(), False
    runs: dict[str, list[Cell]] = {}

    def close_level(clients: int) -> None:
        for name in methods:
            if runs.get(name):
                cell = summarize(name, clients, runs[name])
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)

    clients = 0
    try:
        for name in methods:
            measure_cell(url, key, model, prompts, name, 1, 1, min(8, max_tokens), sampling)
        for clients in levels:
            runs = {name: [] for name in methods}
            for repeat in range(repeats):
                for name in methods if repeat % 2 == 0 else methods[::-1]:
                    runs[name].append(
                        drive(url, key, model, prompts, name, clients, per_client, max_tokens, stop, sampling)
                    )
            close_level(clients)
            runs = {}
    except KeyboardInterrupt:
        stop.set()  # the clients send no more; the server's rows end as their connections close
        interrupted = True
        close_level(clients)
    plain = {c.size: c for c in cells if c.method == "plain"}
    for cell in cells:
        base = plain.get(cell.size)
        if base is not None and not cell.errors and not base.errors:  # none where requests failed
            cell.speedup = rate(cell.tokens_per_second, base.tokens_per_second)
    return cells, interrupted


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile, interpolated between the two nearest values (numpy's default): the p50 of
    two requests is their mean, not the slower one."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def table(cells: list[Cell], title: str) -> Table:
    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for name in (
        "clients",
        "method",
        "requests",
        "tok/s",
        "vs plain",
        "acceptance",
        "TTFT p50",
        "TTFT p95",
        "s/token p50",
        "s/token p95",
        "errors",
        "tok/s by run",
    ):
        t.add_column(name, justify="left" if name == "method" else "right")
    for i, c in enumerate(cells):
        last = i + 1 == len(cells) or cells[i + 1].size != c.size
        t.add_row(
            str(c.size),
            escape(c.method),
            str(c.count),
            f"{c.tokens_per_second:.1f}",
            "–" if c.speedup is None else f"{c.speedup:.2f}x",
            "–" if c.acceptance_rate is None else f"{c.acceptance_rate:.0%}",
            f"{c.ttft_p50:.2f}",
            f"{c.ttft_p95:.2f}",
            f"{c.tpot_p50:.3f}",
            f"{c.tpot_p95:.3f}",
            str(len(c.errors)),
            " ".join(f"{r:.1f}" for r in c.runs) if len(c.runs) > 1 else "",
            end_section=last,
        )
    return t
