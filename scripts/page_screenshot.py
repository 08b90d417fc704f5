"""The README's picture of the chat page: starts `mirror-mlx serve` (the demo pair, speculating, or --serve's
arguments) on a free loopback port, asks it one question in headless Chromium (tests/browser.py: Debian's chromium
and chromium-driver), and saves the page as a PNG (palette-quantized when Pillow is there, to keep it small).

    .venv/bin/python scripts/page_screenshot.py                  # docs/page.png
    .venv/bin/python scripts/page_screenshot.py --out /tmp/p.png --serve "--model build/real-pair/target ..."
"""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import browser  # noqa: E402


def serve(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A server on a free port; its base URL once it listens."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", *args], stdout=out, stderr=out,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if " on http://" in line:
                return proc, line.split(" on ")[1].split()[0].removesuffix("/v1")
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text()}")


def shoot(url: str, out: Path, prompt: str, max_tokens: int, width: int, height: int) -> None:
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}  # a first request warms
    urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),  # it up
                                                  {"Content-Type": "application/json"}), timeout=300).read()
    with browser.chromium(width, height) as web:
        web.get(url + "/")
        WebDriverWait(web, 30).until(lambda w: w.find_element("id", "model").text != "…")
        field = web.find_element("id", "max-tokens")
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys(str(max_tokens))
        web.find_element("id", "input").send_keys(prompt, Keys.ENTER)
        WebDriverWait(web, 300).until(lambda w: w.find_elements("css selector", ".msg.assistant .body[data-done]"))
        web.execute_script("document.activeElement.blur()")
        web.save_screenshot(str(out))


def shrink(path: Path) -> None:
    """A 256-colour palette: the page is flat colours and text, so it reads the same at a third of the bytes."""
    try:
        from PIL import Image
    except ImportError:
        return
    Image.open(path).convert("RGB").quantize(256, method=Image.Quantize.MAXCOVERAGE).save(path, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "page.png")
    ap.add_argument("--serve", default="--mode mirror --kappa 8 --gamma 7", help="mirror-mlx serve's arguments")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--size", default="1200x640", help="the window, WIDTHxHEIGHT")
    a = ap.parse_args()
    why = browser.missing()
    if why:
        sys.exit(f"page_screenshot: {why}")
    width, height = map(int, a.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(shlex.split(a.serve), Path(tmp) / "server.log")
        try:
            shoot(url, a.out, a.prompt, a.max_tokens, width, height)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    shrink(a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
