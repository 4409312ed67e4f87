"""The form each model of a planned pair is read in, chosen between planning and reading.

A GGUF or catalog source on the CPU whose linears will run in int8 (`--target-quant`,
`--draft-quant`: quant.py) is read from its int8 store (int8_store.py), built first when there is
none, never from a converted full-precision copy; every other model reads its full-precision
files. This is the runtime's one step of the loading path between the models layer's two
(models/plan.py plans the pair, models/load.py reads what the plan names): `choose` takes the
plan and gives it back with each stored model's store as the directory it reads, and the
store's checked `rest` shards as the only weight files read (its int8 shards are checked when
their rows are read, int8_store.int8_weights).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import torch

from specgen.config import ModelSettings
from specgen.models.plan import PairPlan, Planned
from specgen.runtime import int8, int8_store, quant
from specgen.status import note


def dtype_auto(settings: ModelSettings) -> bool:
    return (settings.dtype or "auto").strip().lower() == "auto"


def choose(plan: PairPlan, settings: ModelSettings, quiet: bool = False) -> PairPlan:
    """`plan` with each model on the int8 path read from its store (built once: on a first run
    the draft's in a second process beside the target's)."""
    target_stored = _target_stored(plan.target, settings)
    draft_stored = plan.draft is not None and _draft_stored(plan.draft, settings)
    if target_stored and draft_stored:
        _build_side_by_side(plan.target, plan.draft, quiet)
    return PairPlan(
        _from_store(plan.target, quiet) if target_stored else plan.target,
        _from_store(plan.draft, quiet) if draft_stored else plan.draft,
    )


def choose_draft(planned: Planned, settings: ModelSettings, quiet: bool = False) -> Planned:
    """A draft planned alone (chat's /method and /load, bench's `method@draft` columns) in its form."""
    return _from_store(planned, quiet) if _draft_stored(planned, settings) else planned


def _stored(planned: Planned) -> bool:
    """A GGUF or catalog source whole on the CPU, where the int8 kernels run."""
    return (
        planned.resolved is not None
        and planned.resolved.source in ("gguf", "catalog")
        and planned.device_map is None
        and planned.device.type == "cpu"
        and int8.available()
    )


def _target_stored(planned: Planned, settings: ModelSettings) -> bool:
    """A GGUF target that will run with int8 linears on the CPU loads from its int8 store."""
    return _stored(planned) and quant.target_wants_int8(settings.target_quant, dtype_auto(settings))


def _draft_stored(planned: Planned, settings: ModelSettings) -> bool:
    """A GGUF draft whose `--draft-quant` makes every linear int8 loads from its int8 store."""
    return _stored(planned) and quant.draft_wants_int8(
        settings.draft_quant, planned.device, planned.dtype, dtype_auto(settings)
    )


def _from_store(planned: Planned, quiet: bool) -> Planned:
    return planned.reading(*int8_store.checked(planned.resolved, planned.dtype, quiet))


def _build_side_by_side(target: Planned, draft: Planned, quiet: bool = False) -> None:
    """On a first run, build the draft's int8 store in a child process while this one builds the
    target's. Each build spends most of its time on one thread (parsing the GGUF's vocabulary,
    making the tokenizer from it), so two cores do the two side by side (benchmarks/first-run.md).
    Does nothing unless neither store exists yet; a child that fails changes nothing (the draft's
    own load builds it and says why)."""
    if torch.cuda.is_available() or (os.cpu_count() or 1) < 2:
        return
    sources, dtype = (target.resolved, draft.resolved), target.dtype  # both on the CPU: one dtype
    if sources[0].key == sources[1].key or any(
        int8_store.is_store(int8_store.store_dir(r.key, dtype)) for r in sources
    ):
        return
    if not quiet:
        note(f"building the int8 weights of {sources[1].name} alongside, in a second process")
    # one dequantizing thread each: the two processes fill the two cores, and the tensors in
    # flight (a 151936-row table is 0.9 GB in fp32) are half as many at the peak
    child = multiprocessing.get_context("spawn").Process(
        target=_build_quietly, args=(sources[1], dtype), daemon=True
    )
    _start_ignoring_ctrl_c(child)
    try:
        int8_store.ensure(sources[0], dtype, quiet, 1)
        child.join()
    finally:  # Ctrl-C or a failure here: the child stops too (what it wrote was a temporary)
        if child.is_alive():
            child.terminate()
            child.join()


def _start_ignoring_ctrl_c(child) -> None:
    """Start `child` with SIGINT ignored (inherited across exec, and Python then installs no
    KeyboardInterrupt handler): a Ctrl-C reaches the whole process group, and the child must
    print nothing. This process stops it instead (`terminate`)."""
    if threading.current_thread() is not threading.main_thread():
        child.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _build_quietly(source, dtype: torch.dtype) -> None:
    """The child's side of `_build_side_by_side`: any failure is left to the draft's own load,
    which builds the store again and says why in one line."""
    try:
        int8_store.ensure(source, dtype, True, 1)
    except BaseException:  # noqa: BLE001 (Ctrl-C included): nothing printed here, ever
        pass
