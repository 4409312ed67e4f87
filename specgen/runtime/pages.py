"""Weights in 2 MB pages.

A decode step on a CPU reads every weight from memory once: 1.5 GB for the default target in
int8, in 4 KB pages about 380,000 of them, each a translation the processor must look up and
a boundary its prefetchers stop at. In 2 MB pages the same weights are 750 pages. Measured in
one process, on the same weights packed twice (benchmarks/cpu-speed.md, "Weights in 2 MB
pages"): the target's one-token step 0.88-0.90x as long, a verify of 6 tokens 0.94x and the
draft's step 0.94-0.96x.

Linux gives a process 2 MB pages ("transparent huge pages") for memory that asks for them
where the system's setting is `madvise`, the default of Debian and Ubuntu, and for all memory
where it is `always`. glibc 2.35 and later asks for them for every large allocation when the
process starts with GLIBC_TUNABLES=glibc.malloc.hugetlb=1. That covers the int8 weights, which
fbgemm packs into memory it allocates itself, as well as torch's tensors. glibc reads the
tunable when a process starts, so `specgen`'s model commands start themselves again with it
(cli/app.py); SPECGEN_HUGE_PAGES=off keeps 4 KB pages.

No torch import: the command line decides this before anything is loaded.
"""

from __future__ import annotations

import os
import re

ENVIRONMENT = "SPECGEN_HUGE_PAGES"  # off (or 0, no, false): keep the system's pages
TUNABLE = "glibc.malloc.hugetlb=1"
SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
OFF = ("0", "off", "no", "false")


def system_setting(path: str = SETTING) -> str | None:
    """The system's transparent huge pages setting (always, madvise or never), None where
    there is none (not Linux, or a kernel without them)."""
    try:
        with open(path, encoding="ascii") as fh:
            chosen = re.search(r"\[(\w+)\]", fh.read())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def glibc_version() -> tuple[int, int] | None:
    """This process's glibc as (major, minor); None for another C library."""
    try:
        found = re.fullmatch(r"glibc (\d+)\.(\d+)\S*", os.confstr("CS_GNU_LIBC_VERSION") or "")
    except (ValueError, OSError, AttributeError):
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def asked(environ) -> bool:
    """Did this process start with glibc asking for 2 MB pages?"""
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def restart_environment(environ, setting: str | None, glibc: tuple[int, int] | None) -> dict | None:
    """The environment to start this process again in, so that its large allocations come in
    2 MB pages; None where a restart would change nothing (the system gives them to all
    memory, or to none; glibc too old or absent; already asked) or the user said off."""
    if environ.get(ENVIRONMENT, "").strip().lower() in OFF or asked(environ):
        return None
    if setting != "madvise" or glibc is None or glibc < (2, 35):
        return None
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES")
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    return env


def in_use(environ=None, path: str = SETTING) -> str:
    """What this process's large allocations get: '2 MB' (the system's setting gives them to all
    memory, or glibc asks where it is madvise) or '4 KB'."""
    environ = os.environ if environ is None else environ
    setting = system_setting(path)
    if setting == "always" or (setting == "madvise" and asked(environ)):
        return "2 MB"
    return "4 KB"
