"""The playground: `GET /` on `specgen serve`, a page that shows each round of an answer in the
browser as `specgen run` shows it in a terminal (accepted draft tokens green, rejected ones
struck through in red, the target's own token bold), races methods side by side and reads the
server's /metrics.

The page is three files shipped in the package (static/): HTML, CSS and plain JavaScript, no
build step and nothing from another origin. It holds no secret: the user types the API key,
which the script keeps in sessionStorage and sends only to this server's own API, where every
call still needs it. `GET /` and its two files need no key. Each is sent with a
Content-Security-Policy that allows scripts, styles and connections to this origin only, so a
page that another site frames, or a script that another site injects, gets nothing.
"""

from __future__ import annotations

import threading
import webbrowser
from functools import lru_cache
from importlib import resources
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import Response

FILES = {
    "/": ("playground.html", "text/html; charset=utf-8"),
    "/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
# this origin only; no inline script or style, no frames, no forms posting elsewhere
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@lru_cache(maxsize=None)
def content(name: str) -> bytes:
    """A file of the page, read from the package once."""
    return resources.files("specgen.serve").joinpath("static", name).read_bytes()


def add_routes(app: FastAPI) -> None:
    """GET (and HEAD) of the page and its script and style, with the security headers."""
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, _route(name, media_type), methods=["GET", "HEAD"], include_in_schema=False)


def _route(name: str, media_type: str):
    """A route that answers one fixed file (it takes no parameter: nothing a caller sends names a file)."""

    def page() -> Response:
        return Response(content(name), media_type=media_type, headers=HEADERS)

    return page


def open_page(url: str, say: Callable[[str], None]) -> threading.Thread:
    """The playground of the server at `url` in the user's browser (webbrowser: $BROWSER, else
    the desktop's), on a thread of its own: a $BROWSER command is waited for (a terminal browser
    until it quits), and the server's event loop must go on answering meanwhile. Where none
    opens, `say` gets a line saying where the page is."""

    def browse() -> None:
        try:
            opened = webbrowser.open(url + "/")
        except Exception:  # a broken $BROWSER entry, no display
            opened = False
        if not opened:
            say(f"specgen: no browser could be opened; the playground is at {url}/")

    thread = threading.Thread(target=browse, name="specgen-browser", daemon=True)
    thread.start()
    return thread
