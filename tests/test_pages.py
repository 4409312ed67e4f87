"""2 MB pages for the weights (runtime/pages.py): when a model command starts itself again with
glibc asking for them, and what it reports."""

import os
import subprocess
import sys

import pytest

from specgen.runtime import pages

GLIBC = (2, 36)


def setting_file(tmp_path, text):
    path = tmp_path / "enabled"
    path.write_text(text)
    return str(path)


def test_system_setting_reads_the_bracketed_choice(tmp_path):
    assert pages.system_setting(setting_file(tmp_path, "always [madvise] never\n")) == "madvise"
    assert pages.system_setting(setting_file(tmp_path, "[always] madvise never\n")) == "always"
    assert pages.system_setting(setting_file(tmp_path, "always madvise [never]\n")) == "never"
    assert pages.system_setting(str(tmp_path / "absent")) is None


def test_restart_where_the_system_gives_huge_pages_to_memory_that_asks():
    env = pages.restart_environment({"PATH": "/bin"}, "madvise", GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": pages.TUNABLE}


def test_restart_keeps_the_tunables_already_set():
    env = pages.restart_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{pages.TUNABLE}"


@pytest.mark.parametrize(
    "environ, setting, glibc",
    [
        ({}, "always", GLIBC),  # every allocation gets them already
        ({}, "never", GLIBC),  # none can
        ({}, None, GLIBC),  # no such setting: not Linux
        ({}, "madvise", (2, 34)),  # glibc without the tunable
        ({}, "madvise", None),  # another C library
        ({"GLIBC_TUNABLES": pages.TUNABLE}, "madvise", GLIBC),  # asked already: no second restart
        ({"SPECGEN_HUGE_PAGES": "off"}, "madvise", GLIBC),
        ({"SPECGEN_HUGE_PAGES": "0"}, "madvise", GLIBC),
    ],
)
def test_no_restart_where_it_would_change_nothing_or_is_turned_off(environ, setting, glibc):
    assert pages.restart_environment(environ, setting, glibc) is None


def test_in_use_says_which_pages_large_allocations_get(tmp_path):
    madvise = setting_file(tmp_path, "always [madvise] never")
    assert pages.in_use({"GLIBC_TUNABLES": pages.TUNABLE}, madvise) == "2 MB"
    assert pages.in_use({}, madvise) == "4 KB"
    assert pages.in_use({}, setting_file(tmp_path, "[always] madvise never")) == "2 MB"
    assert pages.in_use({"GLIBC_TUNABLES": pages.TUNABLE}, str(tmp_path / "absent")) == "4 KB"


def test_glibc_version_is_a_pair_or_none():
    version = pages.glibc_version()
    assert version is None or (len(version) == 2 and all(isinstance(part, int) for part in version))


# The real entry point, in a child process: its Typer app replaced by one that prints what the
# command ended up running with. After a restart (os.execve of the same command line) the child
# runs this code again, now with glibc asking.
PROBE = """
import os, sys
import specgen.cli.app
module = sys.modules["specgen.cli.app"]
def show():
    print("GLIBC_TUNABLES=" + os.environ.get("GLIBC_TUNABLES", ""), "pages=" + module.pages.in_use())
    raise SystemExit(0)
module.app = show
sys.argv = ["specgen"] + sys.argv[1:]
module.main()
"""

restartable = pytest.mark.skipif(
    pages.restart_environment({}, pages.system_setting(), pages.glibc_version()) is None,
    reason="this machine gives 2 MB pages without a restart, or cannot give them (see runtime/pages.py)",
)


def probe(*args, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", pages.ENVIRONMENT)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@restartable
def test_a_model_command_starts_again_with_glibc_asking_for_huge_pages():
    assert probe("run", "hello") == f"GLIBC_TUNABLES={pages.TUNABLE} pages=2 MB"
    assert probe("bench", "--prompts", "quick").startswith(f"GLIBC_TUNABLES={pages.TUNABLE} ")


@restartable
def test_no_restart_for_help_other_commands_or_when_turned_off():
    assert probe("run", "--help") == "GLIBC_TUNABLES= pages=4 KB"
    assert probe("models", "list") == "GLIBC_TUNABLES= pages=4 KB"
    assert probe("run", "hello", SPECGEN_HUGE_PAGES="off") == "GLIBC_TUNABLES= pages=4 KB"
