"""User-facing errors: anything raised as SpecgenError is printed as one line, exit code 1."""


class SpecgenError(Exception):
    """A known failure with a message meant for the user (one line, no traceback)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ModelError(SpecgenError):
    """A model could not be found, fetched, verified or loaded."""


class ConfigError(SpecgenError):
    """Impossible or contradictory settings."""


class PromptError(SpecgenError):
    """An empty prompt, or one that does not fit the context."""


class DiskFullError(SpecgenError, OSError):
    """The disk filled while specgen wrote a file: one line saying where and what to do. Also an
    OSError, so a caller that keeps its data elsewhere when a write fails (bench's outputs, a
    chat's /save) still does."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint)
        self.strerror = message  # what callers that report an OSError's strerror print


class PartialReply(SpecgenError):
    """A reply that broke off (the server went away or failed mid-answer): its one line, and
    what came before (`outcome`, marked interrupted), which a chat keeps as a run prints it."""

    def __init__(self, message: str, hint: str | None, outcome):
        super().__init__(message, hint)
        self.outcome = outcome


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's text (empty when it has none), cut at `limit`."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line: a SpecgenError's own message; any other, its type and the
    first line of its text (Python's and the libraries' messages run over many lines)."""
    if isinstance(exc, SpecgenError):
        return str(exc)
    text = first_line(exc, limit)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def file_error(error: OSError) -> SpecgenError:
    """An OSError of the file system as one line naming the path: what `open` and friends say
    when a path is not what specgen expects (a directory where a file goes, a cache that is a file)."""
    where = f" {error.filename}" if error.filename else ""
    return SpecgenError(f"cannot use{where}: {error.strerror or error}")
