"""`specgen run --prompts-file F --output OUT.jsonl [--ray auto|ADDRESS]`: a prompt set written to a
file as each prompt finishes, resumable, in this process or on a Ray cluster; a progress bar
(plain lines when stderr is not a terminal) with prompts done, aggregate tok/s and acceptance."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.cli.options import sigterm_as_ctrl_c
from specgen.config import GenerationConfig, ModelSettings
from specgen.decoding.prompts import read_prompt_records
from specgen.decoding.stats import Stats
from specgen.errors import ConfigError
from specgen.scale.results import ResultsFile, prompt_digest, result_record
from specgen.status import note, status

PLAIN_EVERY = 2.0  # seconds between progress lines when stderr is not a terminal


class PromptProgress:
    """Prompts done (of all, those already in the file included), aggregate tok/s since decoding
    began, acceptance over every prompt finished in this run."""

    def __init__(self, total: int, already: int):
        self.total, self.done = total, already
        self.totals = Stats(method="prompts", generations=0)  # every prompt finished in this run
        self.started = time.perf_counter()
        self.console = Console(emoji=False, file=sys.stderr)
        self._bar: Progress | None = None
        self._printed = 0.0

    def __enter__(self) -> "PromptProgress":
        self.started = time.perf_counter()
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("prompts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._bar.start()
            self._task = self._bar.add_task("prompts", total=self.total, completed=self.done, line="")
        return self

    def advance(self, stats: Stats) -> None:
        self.done += 1
        self.totals = self.totals.merge(replace(stats, tree_sizes=[]))  # the trees' sizes are not shown
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, line=self.figures())
        elif time.perf_counter() - self._printed >= PLAIN_EVERY or self.done == self.total:
            self._printed = time.perf_counter()
            note(f"{self.done}/{self.total} prompts, {self.figures()}")

    def figures(self) -> str:
        # the prompts' own seconds overlap in a batch: the rate is over the wall time since decoding began
        wall = replace(self.totals, seconds=max(time.perf_counter() - self.started, 1e-9))
        accept = f", acceptance {wall.acceptance_rate:.1%}" if wall.drafted else ""
        return f"{wall.wall_tokens_per_second:.1f} tok/s{accept}"

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_to_file(
    prompts_path,
    output,
    batch_size: int,
    raw: bool,
    system: str | None,
    config: GenerationConfig,
    settings: ModelSettings,
    quiet: bool,
    ray_address: str | None = None,
    actors: int | None = None,
    threads: int = 1,
) -> None:
    records = read_prompt_records(prompts_path, unique_ids=True)  # before anything loads
    if ray_address is not None:
        # the optional extra (and its install hint) before any file is touched
        from specgen.scale import cluster

        cluster.import_ray()
        cluster.check(ray_address)  # an address that does not answer: one line, and OUT is not touched
    with ResultsFile.open(output) as results:
        if results.dropped:
            note(f"{output}: dropped a torn last line ({results.dropped} bytes) left by an interrupted run")
        for record in records:
            made = results.done.get(record.id)
            if made is not None and made != prompt_digest(record.text):
                raise ConfigError(
                    f"{output} holds a result for id {json.dumps(record.id)} made from another "
                    f"prompt than line {record.line} of {prompts_path} holds",
                    hint="give another --output, or remove that result's line to decode it again",
                )
        todo = [(i, r.text) for i, r in enumerate(records) if r.id not in results.done]
        already = len(records) - len(todo)
        if not todo:
            note(f"all {len(records)} prompts are already in {output}")
            return
        if already:
            note(f"{already} of {len(records)} prompts already in {output}; decoding the other {len(todo)}")
        written, source = 0, None
        try:
            source = _source(
                todo, batch_size, raw, system, config, settings, quiet, ray_address, actors, threads
            )
            with PromptProgress(len(records), already) as progress:
                for index, outcome in source:
                    results.write(result_record(records[index].id, records[index].text, outcome))
                    written += 1
                    progress.advance(outcome.stats)
        except KeyboardInterrupt:
            results.close()
            note(
                f"interrupted: {written} prompts written to {output} ({already + written} of {len(records)} "
                f"there); rerun the same command to finish"
            )
            raise typer.Exit(130) from None
        finally:
            stop = getattr(source, "stop", None)
            if stop is not None:
                stop()
    note(f"{written} prompts written to {output} ({len(records)} of {len(records)} there)")


def _source(todo, batch_size, raw, system, config, settings, quiet, ray_address, actors, threads):
    """What yields (index, Outcome) as prompts finish: a Decoder here, or a RayRun."""
    if ray_address is None:
        # torch and the models load only once a run needs them (--help and errors stay fast)
        from specgen.scale.local import Decoder

        return Decoder(settings, config, raw, system, quiet=quiet).run(todo, batch_size)
    from specgen.scale import cluster  # the optional extra, checked above

    ray, owned = cluster.connect(ray_address)
    sigterm_as_ctrl_c()  # Ray's core takes SIGTERM for itself when it connects: the results so far are kept
    try:
        run = cluster.RayRun(
            ray, settings, config, raw, system, todo, batch_size, actors, threads, owned=owned
        )
    except BaseException:  # more actors than the cluster holds: one line, and a session we started ends
        if owned:
            ray.shutdown()
        raise
    try:
        with status(f"loading the pair in {len(run.actors)} Ray actors ...", quiet):
            run.wait_ready(quiet)
    except BaseException:
        run.stop()
        raise
    return run


def check_options(prompts_file, output, ray_address, actors, threads) -> None:
    """--output, --ray and their companions, checked before anything loads."""
    if output is not None and prompts_file is None:
        raise ConfigError("--output writes the results of --prompts-file", hint="give --prompts-file FILE")
    if ray_address is not None and output is None:
        raise ConfigError("--ray writes its results to a file", hint="give --output OUT.jsonl")
    if ray_address is None and (actors is not None or threads is not None):
        raise ConfigError("--ray-actors and --ray-threads go with --ray")
    if actors is not None and actors < 1:
        raise ConfigError(f"--ray-actors must be >= 1, got {actors}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--ray-threads must be >= 1, got {threads}")
