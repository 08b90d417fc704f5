"""How far one request reaches into mirror_mlx: the modules it enters and the deepest chain of mirror_mlx
calls per thread, for `mirror-mlx generate --prompt X` and for one server request (the demo pair).

    python scripts/request_path.py [--prompt "Once upon a time"] [--max-tokens 16] [--json]

Only this process is counted (the draft host process is not). Depth counts mirror_mlx frames on a
thread's stack; a thread is named by its name at its first call. The load and the first-call
calibration are part of the path (that is what a first request runs)."""

import argparse
import io
import json
import sys
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from contextlib import redirect_stdout


class PathCount:
    """A profile hook: the mirror_mlx modules entered and each thread's deepest mirror_mlx call chain."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.depth: dict[str, int] = defaultdict(int)
        self.local = threading.local()

    def __call__(self, frame, event, arg) -> None:
        if event not in ("call", "return"):
            return
        local = self.local
        if not hasattr(local, "stack"):
            local.stack, local.name = [], threading.current_thread().name.split(" ")[0].rstrip("0123456789-")
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            ours = name == "mirror_mlx" or name.startswith("mirror_mlx.")
            local.stack.append(ours)
            if ours:
                self.modules.add(name)
                d = sum(local.stack)
                if d > self.depth[local.name]:
                    self.depth[local.name] = d
        elif local.stack:
            local.stack.pop()

    def start(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self) -> dict:
        sys.setprofile(None)
        threading.setprofile(None)
        return {"modules": len(self.modules), "max_depth": max(self.depth.values(), default=0),
                "depth_per_thread": dict(sorted(self.depth.items())), "module_names": sorted(self.modules)}


def generate(prompt: str, max_tokens: int) -> dict:
    from mirror_mlx.cli import main

    count = PathCount()
    count.start()
    try:
        with redirect_stdout(io.StringIO()):
            main.main(["generate", "--prompt", prompt, "--max-tokens", str(max_tokens)], standalone_mode=False)
    finally:
        out = count.stop()
    return out


def server_request(prompt: str, max_tokens: int) -> dict:
    from mirror_mlx.pipeline import load
    from mirror_mlx.server.http import Server

    count = PathCount()
    count.start()
    try:
        pipe = load()
        server = Server(("127.0.0.1", 0), pipe, "demo", {"mode": "auto", "temperature": 0.0, "top_p": 1.0, "top_k": 0},
                        log=io.StringIO())
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="http")
        thread.start()
        port = server.server_address[1]
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"the server answered {e.code}: {e.read().decode()}")
        server.shutdown()
        server.server_close()
        thread.join()
        pipe.close()
    finally:
        out = count.stop()
    out["text"] = reply["choices"][0]["text"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="also list the module names")
    args = ap.parse_args()
    results = {"generate": generate(args.prompt, args.max_tokens),
               "server": server_request(args.prompt, args.max_tokens)}
    for name, r in results.items():
        print(f"{name}: {r['modules']} modules of mirror_mlx entered, max call depth {r['max_depth']} "
              f"(per thread: {r['depth_per_thread']})")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
