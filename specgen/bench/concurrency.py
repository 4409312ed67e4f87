"""`specgen bench serve --concurrency 1,2,4,8`: a running HTTP server driven by N concurrent
streaming clients, per method: aggregate throughput, time to first token and time per output
token (p50 and p95 over the requests), speculative against plain at the same concurrency.

Knows nothing about how the server was started: it is given the server's URL, key and model
id (cli/bench_serve.py starts one on the loaded pair). Stdlib HTTP only.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from rich.markup import escape
from rich.table import Table

from specgen.bench.methods import in_turn, variant
from specgen.bench.report import with_old_keys
from specgen.bench.summary import quantile
from specgen.config import Method
from specgen.decoding.stats import Stats, rate
from specgen.errors import ConfigError


@dataclass
class ClientsCell:
    """One method at one number of concurrent streaming clients against a server: the requests
    of one run, or of its runs pooled, each as its client saw it; their tokens over the wall time
    of the run(s), their time to the first token and per token, the speed-up over plain at the
    same number of clients."""

    method: str
    concurrency: int  # streaming clients
    timings: list[Stats]  # each answered request's Stats, as its client saw it (not written)
    seconds: float  # wall time of the run, or of its runs together
    errors: list[str] = field(default_factory=list)  # failed requests, one line each
    runs: list[float] = field(default_factory=list)  # each run's tok/s, in order: the machine's drift shows
    speedup: float | None = None  # over plain at the same number of clients

    @property
    def totals(self) -> Stats:
        """The requests pooled over the cell's wall time; drafts of those the server summarized
        (as the per-prompt bench pools: no acceptance where nothing was drafted)."""
        summarized = [t for t in self.timings if t.generations]
        return Stats(
            method=self.method,
            generations=len(summarized),
            new_tokens=sum(t.new_tokens for t in self.timings),
            seconds=self.seconds,
            drafted=sum(t.drafted for t in summarized),
            accepted=sum(t.accepted for t in summarized),
        )

    @property
    def requests(self) -> int:
        return len(self.timings)

    @property
    def tokens(self) -> int:
        return self.totals.new_tokens

    @property
    def wall_tokens_per_second(self) -> float:
        return self.totals.wall_tokens_per_second

    @property
    def acceptance_rate(self) -> float | None:
        return self.totals.acceptance

    @property
    def ttft_p50(self) -> float:
        return quantile(self._ttfts(), 0.5)

    @property
    def ttft_p95(self) -> float:
        return quantile(self._ttfts(), 0.95)

    @property
    def tpot_p50(self) -> float:
        """Seconds per output token after the first, the median over the requests."""
        return quantile(self._tpots(), 0.5)

    @property
    def tpot_p95(self) -> float:
        return quantile(self._tpots(), 0.95)

    def _ttfts(self) -> list[float]:
        return [t.time_to_first_token for t in self.timings] or [0.0]

    def _tpots(self) -> list[float]:
        return [t.seconds_per_token for t in self.timings if t.seconds_per_token is not None] or [0.0]

    def record(self) -> dict:
        """The cell as `bench serve`'s JSON writes it (RECORD_FIELDS, and the keys kept for a release)."""
        return with_old_keys({name: getattr(self, name) for name in RECORD_FIELDS})


# a cell's JSON fields, in this order
RECORD_FIELDS = (
    "method",
    "concurrency",
    "requests",
    "tokens",
    "seconds",
    "wall_tokens_per_second",  # and its old key, tokens_per_second, for one release (report.OLD_KEYS)
    "ttft_p50",
    "ttft_p95",
    "tpot_p50",
    "tpot_p95",
    "acceptance_rate",
    "speedup",
    "errors",
    "runs",
)


def speculative(name: str) -> dict:
    """A bench method name (`plain`, `chain`, `chain/k2`, ...) as the request's `speculative` field."""
    methods = {m.value: m for m in Method}
    if name in methods:
        return {"method": name}
    found = variant(name)
    if found is None:
        raise ConfigError(f"bench serve measures specgen's own methods; '{name}' is not one")
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
    # the first text chunk counts as one token: the stream does not say how many it carries
    seen = Stats(method=body["speculative"]["method"], generations=0, first_tokens=1)
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
) -> ClientsCell:
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
) -> ClientsCell:
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
    return ClientsCell(name, clients, timings, time.perf_counter() - started, errors)


def summarize(name: str, clients: int, runs: list[ClientsCell]) -> ClientsCell:
    """A cell from its runs pooled: tokens over seconds of all runs, quantiles over all requests,
    and each run's tok/s."""
    return ClientsCell(
        name,
        clients,
        [t for run in runs for t in run.timings],
        sum(run.seconds for run in runs),
        [e for run in runs for e in run.errors],
        runs=[run.wall_tokens_per_second for run in runs],
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
) -> tuple[list[ClientsCell], bool]:
    """Every method at every concurrency after one warm-up request per method. Each level runs
    its methods `repeats` times, every other time in reverse order (plain, chain, chain, plain,
    ...), so drift in the machine's speed hits every method alike; a cell pools its runs.
    Returns the cells and whether Ctrl-C stopped the run: the level it stopped in keeps a cell
    per method from the runs that finished (its `runs` says how many)."""
    cells, stop, interrupted = [], threading.Event(), False
    runs: dict[str, list[ClientsCell]] = {}

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
                for name in in_turn(methods, repeat):
                    runs[name].append(
                        drive(url, key, model, prompts, name, clients, per_client, max_tokens, stop, sampling)
                    )
            close_level(clients)
            runs = {}
    except KeyboardInterrupt:
        stop.set()  # the clients send no more; the server's rows end as their connections close
        interrupted = True
        close_level(clients)
    plain = {c.concurrency: c for c in cells if c.method == "plain"}
    for cell in cells:
        base = plain.get(cell.concurrency)
        if base is not None and not cell.errors and not base.errors:  # none where requests failed
            cell.speedup = rate(cell.wall_tokens_per_second, base.wall_tokens_per_second)
    return cells, interrupted


def table(cells: list[ClientsCell], title: str) -> Table:
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
        last = i + 1 == len(cells) or cells[i + 1].concurrency != c.concurrency
        t.add_row(
            str(c.concurrency),
            escape(c.method),
            str(c.requests),
            f"{c.wall_tokens_per_second:.1f}",
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
