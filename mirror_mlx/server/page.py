"""The chat page at `/`: the package's own static files (mirror_mlx/page/: no build step, nothing fetched from
elsewhere, so it works offline), served to the pages the server already lets call its API."""

from typing import Callable, Optional

from ..timeline import PAGE

FILES = {"": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
         "/page.css": ("page.css", "text/css; charset=utf-8"),
         "/timeline.js": ("timeline.js", "text/javascript; charset=utf-8"),
         "/chat.js": ("chat.js", "text/javascript; charset=utf-8")}
# the page runs its own files only, talks to this server only, and no other site can frame it
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                      "base-uri 'none'; form-action 'none'"}


def refusal(host: Optional[str], site: Optional[str], dest: Optional[str],
            allowed: Callable[[str], bool]) -> Optional[str]:
    """Why a page file is not served (None: it is). The page's own origin, http:// and the Host it was asked
    at, must be one the server allows, since the page calls the API from there (a name that merely resolves
    here, as in DNS rebinding, gets nothing); and another site may link to the page but not load it into its
    own (Sec-Fetch-Site and -Dest: a frame, a script, a fetch)."""
    if host and not allowed(f"http://{host}"):
        return (f"the chat page is not served to pages at http://{host}: open it at http://localhost, or start the "
                f"server with --allowed-origins http://{host}")
    if site == "cross-site" and dest not in (None, "document"):
        return "another site may link to the chat page but not load it into its own page"
    return None


def read(path: str) -> Optional[tuple[bytes, str]]:
    """(the file's bytes, its content type) for a page path, or None: not a page file."""
    if path not in FILES:
        return None
    name, kind = FILES[path]
    return (PAGE / name).read_bytes(), kind
