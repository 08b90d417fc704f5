"""The chat from outside: `mirror-mlx chat` as a command line, or on a pseudo-terminal that a test types into."""

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
TURNS = ["Once upon a time", "The dog barked.", "Then the sun came out."]  # what the chat tests type
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cli(*args, ctty=False):
    """`mirror-mlx ARGS` as a Python command line (ctty: take stdin as the controlling terminal)."""
    code = "import sys; sys.argv[0] = 'mirror-mlx'; from mirror_mlx.cli import main; main()"
    if ctty:  # so that Ctrl-C typed on the terminal sends SIGINT to it, as in a shell
        code = "import fcntl, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); " + code
    return [sys.executable, "-c", code, *args]


class Terminal:
    """The chat on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, *args):
        import pty
        import termios

        self.master, slave = pty.openpty()
        # Ctrl-C makes a terminal discard the output not read yet (NOFLSH unset). A user's terminal reads it at
        # once; the test reads only while it waits for something, so a second Ctrl-C would discard a note the
        # first one printed. Keep it.
        attrs = termios.tcgetattr(slave)
        attrs[3] |= termios.NOFLSH
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        # a user's terminal delivers Ctrl-C; a runner that started us in the background may ignore SIGINT,
        # and an ignored signal stays ignored across exec, so give the chat the default action back
        self.proc = subprocess.Popen(cli(*args, ctty=True), cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(slave)
        self.seen = ""  # output not matched yet
        self.log = ""  # all output, for failure messages

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_for_keys(self, timeout: float = 60.0) -> None:
        """Block until the chat waits in readline for the next key (its main thread in select() on stdin).

        Python's readline notices a signal only when it interrupts that select(): a Ctrl-C that lands while
        readline still handles the previous key (or draws the prompt) waits for the next key. A user's
        keys come far apart; the test's come microseconds after the echo, so it waits for this first.
        Linux reads /proc/PID/syscall; elsewhere a pause stands in."""
        path = Path(f"/proc/{self.proc.pid}/syscall")
        if not path.exists():
            time.sleep(0.5)
            return
        end = time.monotonic() + timeout
        while True:
            try:
                fields = path.read_text().split()
            except OSError:
                fields = []
            # select / pselect6 (x86_64: 23, 270; arm64: 72) on 1 descriptor: stdin (fd 0)
            if len(fields) > 1 and fields[0] in ("23", "270", "72") and fields[1] == "0x1":
                return
            assert self.proc.poll() is None, f"the chat exited: {self.log[-2000:]!r}"
            assert time.monotonic() < end, f"the chat never waited for a key: {self.log[-2000:]!r}"
            time.sleep(0.02)

    def expect(self, pattern: str, timeout: float = 120.0, required: bool = True) -> Optional[re.Match]:
        """Read until `pattern` shows up in the output after what was matched before (hang guard only)."""
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                self.seen = self.seen[m.end() :]
                return m
            left = end - time.monotonic()
            if left <= 0 and not required:
                return None
            assert left > 0, f"no {pattern!r} after {self.log[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    text = ANSI.sub("", os.read(self.master, 4096).decode(errors="replace"))
                except OSError:  # the child closed the terminal
                    assert re.search(pattern, self.seen), f"no {pattern!r} after {self.log[-2000:]!r}"
                self.seen += text
                self.log += text

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)

