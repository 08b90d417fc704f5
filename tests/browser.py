"""Headless Chromium through chromium-driver (Debian's packages: scripts/setup.sh installs them on Linux as root),
driven by Selenium: for the chat page's tests and scripts/page_screenshot.py. The browser reaches nothing but
this machine: no sync, updates or background fetches, a fresh profile each time."""

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Iterator, Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--hide-scrollbars")


def find() -> tuple[Optional[str], Optional[str]]:
    """(the browser, its driver), each None when missing."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    return browser, shutil.which("chromedriver")


def missing() -> Optional[str]:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra: make setup)"
    browser, driver = find()
    if browser and driver:
        return None
    return ("no chromium and chromium-driver on this machine: scripts/setup.sh installs Debian's on Linux as root; "
            "elsewhere install Chromium and its driver")


def must_run() -> bool:
    """Where the set-up installs the browser (Linux, root, apt) under CI, a missing one is a failure, not a skip."""
    return bool(os.environ.get("CI")) and sys.platform == "linux" and os.geteuid() == 0 and bool(shutil.which("apt-get"))


@contextlib.contextmanager
def chromium(width: int = 1200, height: int = 800, args: tuple = ()) -> Iterator:
    """A headless Chromium window of `width` × `height` CSS pixels, with `args` added to its flags."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = find()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # Chromium aborts under a preloaded BLAS
    with tempfile.TemporaryDirectory(prefix="mirror-mlx-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in FLAGS + (f"--user-data-dir={profile}", f"--window-size={width},{height}") + tuple(args):
            options.add_argument(flag)
        web = webdriver.Chrome(options=options, service=Service(driver, env=env))
        try:
            web.set_window_size(width, height)
            yield web
        finally:
            web.quit()
