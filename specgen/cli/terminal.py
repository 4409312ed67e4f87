"""The terminal under `specgen chat`: its prompt, line editing with bracketed paste, and keys
unechoed while a reply streams. Each helper falls back to plain input where the platform lacks
readline or termios (Windows, a pipe)."""

from __future__ import annotations

import contextlib
import sys

PROMPT = "\001\033[1;36m\002you>\001\033[0m\002 "  # \001 \002: readline does not count the colour codes
PLAIN_PROMPT = "you> "


def prompt() -> str:
    """The coloured prompt on a terminal, a plain one when stdout is not."""
    return PROMPT if sys.stdout.isatty() else PLAIN_PROMPT


@contextlib.contextmanager
def keys_unechoed(terminal: bool):
    """While a reply streams, keys typed are not echoed (the echo broke the live view's lines);
    the terminal keeps them, and the next prompt's line shows them."""
    saved = None
    if terminal:
        try:
            import termios  # not on every platform

            fd = sys.stdin.fileno()
            saved = termios.tcgetattr(fd)
        except Exception:  # noqa: BLE001 - no termios, or no terminal after all (termios.error is no OSError)
            saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def line_editing():
    """Line editing and in-session history for input(), where the platform has readline, with
    bracketed paste: a pasted text of several lines is one message (CPython turns it off, and
    each pasted line was sent as a message of its own). The readline module, or None."""
    try:
        import readline  # not on every platform: imported where it exists
    except ImportError:  # e.g. Windows without pyreadline: input() still works, unedited
        return None
    if "libedit" not in (readline.__doc__ or ""):  # GNU readline's setting (macOS's libedit has none)
        readline.parse_and_bind("set enable-bracketed-paste on")
    return readline
