"""The command line (Typer): `specgen run|chat|bench|serve|models`; `main` is the entry point."""

from specgen.cli.app import app, exit_status, main

__all__ = ["app", "exit_status", "main"]
