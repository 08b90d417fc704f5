"""Faults a user or a client can cause must leave them no worse off: one clear error, and the
server, the draft host and the cache stay usable. Real server subprocess, real sockets, real models."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mirror_mlx
from mirror_mlx.tune import profile as profiles
from tests import leaks
from tests.support import assert_lossless
from tests.support.processes import children, orphans
from tests.support.servers import running

LINUX = sys.platform.startswith("linux")


def raw_http(url: str, request: bytes, timeout: float = 30) -> tuple[int, dict]:
    """Send bytes as they are (a client library would fix or refuse them); (status, JSON body)."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post_bytes(url: str, body: bytes, path: str = "/v1/completions", headers: str = "") -> tuple[int, dict]:
    if "Content-Length" not in headers and "Transfer-Encoding" not in headers:
        headers += f"Content-Length: {len(body)}\r\n"
    return raw_http(url, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                         f"Connection: close\r\n\r\n".encode() + body)


def completion(url: str, **fields) -> tuple[int, dict]:
    return post_bytes(url, json.dumps({"prompt": "Once upon a time", "max_tokens": 8, **fields}).encode())


def one_line_error(status: int, body: dict, expected: int) -> str:
    assert status == expected, body
    message = body["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def server(serve):
    """Stopped with SIGTERM at the end (conftest.serve checks it ends cleanly, whatever these faults did)."""
    return serve("--mode", "mirror", "--max-queue", "4", stop=signal.SIGTERM)


def speculates(url: str) -> dict:
    status, body = completion(url, mode="mirror", kappa=4, gamma=4)  # (knobs: no calibration in the server)
    assert status == 200, body
    stats = body["x_mirror"]
    assert stats["mode"] == "mirror" and stats["draft_failure"] is None, stats
    return stats


# --- the server ---------------------------------------------------------------------------------


def test_huge_kappa_and_gamma_are_a_400_and_the_draft_stays_on(server):
    url = server.base
    message = one_line_error(*completion(url, mode="mirror", kappa=512, gamma=16), 400)
    assert "8704 draft branches" in message and "limit is 256" in message
    status, body = completion(url, mode="auto", kappa=64, gamma=15)
    assert one_line_error(status, body, 400) and body["error"]["param"] == "kappa"
    speculates(url)


def test_a_lone_surrogate_is_replaced_not_a_500(server):
    url = server.base
    for body in (b'{"prompt": "Once \\ud800 upon", "max_tokens": 4}',
                 b'{"messages": [{"role": "user", "content": "Hi \\udfff"}], "max_tokens": 4}'):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, answer = post_bytes(url, body, path)
        assert status == 200, answer


def test_deeply_nested_json_is_a_400(server):
    url = server.base
    assert "nests too deeply" in one_line_error(*post_bytes(url, b"[" * 100000), 400)


def test_chunked_bodies_and_bad_content_length_are_named(server):
    url = server.base
    body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    message = one_line_error(*post_bytes(url, chunked, headers="Transfer-Encoding: chunked\r\n"), 411)
    assert "Transfer-Encoding: chunked" in message and "Content-Length" in message
    message = one_line_error(*post_bytes(url, body, headers="Content-Length: -5\r\n"), 400)
    assert "Content-Length header is invalid ('-5')" in message


@pytest.mark.parametrize("raw,param", [(b'{"prompt": "x", "temperature": Infinity}', "temperature"),
                                       (b'{"prompt": "x", "top_p": NaN}', "top_p"),
                                       (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
                                       (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}}',
                                        "stream_options.include_usage")])
def test_non_finite_numbers_and_non_boolean_flags_name_the_field(server, raw, param):
    url = server.base
    status, body = post_bytes(url, raw)
    one_line_error(status, body, 400)
    assert body["error"]["param"] == param


def test_a_prompt_too_long_for_the_context_is_refused_before_it_queues(server):
    url = server.base
    status, body = completion(url, prompt="Once upon a time " * 600_000)  # 10 MB
    message = one_line_error(status, body, 413)
    assert "bytes" in message and body["error"]["code"] == "context_length_exceeded"
    status, body = post_bytes(url, json.dumps({"prompt": [1] * 5000, "max_tokens": 2}).encode())
    assert "context is" in one_line_error(status, body, 400)


def test_a_burst_of_connections_is_answered_not_reset(server):
    """More connections at once than the old listen backlog of 5: each gets an answer (200 or 429)."""
    url = server.base
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"prompt": "Once", "max_tokens": 1}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    socks = [socket.create_connection((host, int(port)), timeout=60) for _ in range(50)]
    for s in socks:
        s.sendall(request)
    statuses = []
    for s in socks:
        with s:
            statuses.append(int(s.recv(64).split()[1]))
    assert set(statuses) <= {200, 429} and 200 in statuses
    if LINUX:  # Linux retries a SYN past the backlog instead of resetting it: read the backlog itself
        listen = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
        assert int(listen[2]) >= 50, listen  # ss: a listening socket's Send-Q is its backlog


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_an_idle_connection_does_not_delay_shutdown(tmp_path, sig):
    """A browser's preconnect sends nothing; SIGINT (or SIGHUP: the terminal closed) stops at once,
    and the draft host and its shared memory go with the server."""
    log = tmp_path / "server.log"
    with running(log, "--mode", "mirror") as (proc, url):
        idle_connection_does_not_delay(proc, url, log, sig)


def idle_connection_does_not_delay(proc, url: str, log, sig: int) -> None:
    host, port = url.split("//")[1].split("/")[0].split(":")
    speculates(url.removesuffix("/v1"))
    kids = children(proc.pid)
    shm = leaks.mapped(proc.pid) | set(leaks.made_in(log.read_text()))
    idle = socket.create_connection((host, int(port)))
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig) if sig == signal.SIGHUP else proc.send_signal(sig)  # a hang-up reaches the group
    assert proc.wait(timeout=20) == 0, log.read_text()
    assert time.monotonic() - t0 < 10, "shutdown waited on the idle connection"  # was Handler.timeout, 30 s
    idle.close()
    assert not orphans(kids), "an orphan process outlived the server"
    assert shm and leaks.wait_unlinked(shm) == [], "the server left a shared-memory segment behind"


# --- the API: knobs, the tuning cache, profiles ---------------------------------------------------


def test_kappa_gamma_beyond_the_draft_host_are_a_value_error_and_the_draft_stays_on(pipe):
    with pytest.raises(ValueError, match=r"kappa\*\(gamma\+1\) = 8704 draft branches.*limit is 256"):
        pipe.generate("Once upon a time", max_tokens=8, mode="mirror", kappa=512, gamma=16)
    out = pipe.generate("Once upon a time", max_tokens=8, mode="mirror", kappa=16, gamma=15)  # exactly 256
    assert out.stats.mode == "mirror" and out.stats.draft_failure is None


def fresh_auto(pipe) -> None:
    """Forget the pipeline's profile so the next mode="auto" call looks for one again."""
    pipe.auto.profile = None


def test_an_unwritable_cache_keeps_the_calibration_in_memory(pipe, tmp_path, monkeypatch, capfd):
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("a file where the cache folder should be")
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(not_a_folder))
    fresh_auto(pipe)
    reference = pipe.generate("Once upon a time", max_tokens=12, mode="ar").text
    assert pipe.generate("Once upon a time", max_tokens=12).text == reference  # mode auto: calibrates
    assert pipe.generate("Once upon a time", max_tokens=12).text == reference  # from memory
    err = capfd.readouterr().err
    assert err.count("cannot write the tuning profile") == 1 and "kept in memory" in err, err
    assert "Traceback" not in err


def test_a_failed_profile_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    prof = profiles.Profile(key={"target": "t", "draft": "d", "adapter": "none", "machine": "m"}, mode="ar")
    profiles.path_for(prof.key).mkdir()  # the rename onto it fails after the temporary file is written
    with pytest.raises(profiles.ProfileError, match="cannot write the tuning profile"):
        profiles.save(prof)
    assert [p.name for p in tmp_path.iterdir()] == [profiles.path_for(prof.key).name]


@pytest.mark.parametrize("knobs,named", [(dict(kappa=0, gamma=300), "kappa: 0"),
                                         (dict(kappa=8, gamma=300), "gamma: 300")])
def test_an_out_of_range_profile_names_its_path_and_the_fix(tmp_path, monkeypatch, knobs, named):
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    key = {"target": "t", "draft": "d", "adapter": "none", "machine": "m"}
    profiles.save(profiles.Profile(key=key, mode="mirror", exit_layer=2, **knobs))
    with pytest.raises(profiles.ProfileError) as e:
        profiles.saved(key)
    message = str(e.value)
    assert str(profiles.path_for(key)) in message and named in message and "run `mirror-mlx tune` again" in message


@pytest.mark.parametrize("knobs,named", [(dict(mode="mirror", kappa=0, gamma=300, exit_layer=2), "kappa: 0"),
                                         (dict(mode="sd", gamma=300), "gamma must be at most 256"),
                                         (dict(mode="mirror", kappa=2, gamma=3, exit_layer=9), "exit")])
def test_a_tampered_profile_is_recalibrated_with_a_warning(pipe, tmp_path, monkeypatch, capfd, knobs, named):
    from mirror_mlx.tune.profile import pipe_key

    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    path = profiles.save(profiles.Profile(key=pipe_key(pipe), **knobs))
    fresh_auto(pipe)
    reference = pipe.generate("Once upon a time", max_tokens=12, mode="ar").text
    assert pipe.generate("Once upon a time", max_tokens=12).text == reference
    err = capfd.readouterr().err
    assert f"the tuning profile {path} holds" in err and named in err and "recalibrating" in err, err


# --- loading --------------------------------------------------------------------------------------


def test_a_tokenizer_larger_than_the_model_is_refused_at_load(tmp_path):
    import shutil

    from tests.models import TARGET_PATH

    folder = tmp_path / "mismatched"
    shutil.copytree(TARGET_PATH, folder)
    (folder / "tokenizer.model").unlink()  # the fast tokenizer reads tokenizer.json
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab.update({f"extra{i}": len(vocab) + i for i in range(151_936 - len(vocab))})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"tokenizer has 151936 token ids but the model's vocabulary is 512"):
        mirror_mlx.load(str(folder))


# --- signals --------------------------------------------------------------------------------------


def gone(pids: list[int], shm: set[str]) -> None:
    assert not orphans(pids), "an orphan process outlived the command"
    assert leaks.wait_unlinked(shm) == [], "a shared-memory segment was left behind"


def test_a_hang_up_during_chat_closes_the_draft_host_and_its_shared_memory(tmp_path):
    """The terminal closing sends SIGHUP to the whole process group: the chat ends as on SIGTERM."""
    err = open(tmp_path / "chat.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "chat", "--mode", "mirror", "-m", "300"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                            env=dict(os.environ, **{leaks.TRACE_ENV: "1"}))
    proc.stdin.write(b"Tell me a story\n")
    proc.stdin.flush()
    assert proc.stdout.read(20)  # the reply is streaming
    shm, kids = leaks.mapped(proc.pid) | set(leaks.made_in((tmp_path / "chat.log").read_text())), children(proc.pid)
    assert shm and kids
    os.killpg(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=30) == 128 + signal.SIGHUP, (tmp_path / "chat.log").read_text()
    gone(kids, shm)
    assert "Traceback" not in (tmp_path / "chat.log").read_text()


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_ctrl_c_on_generate_exits_130(tmp_path):
    # a runner that started us in the background ignores SIGINT, and that survives exec: give it back
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "generate", "-p", "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not Path(f"/proc/{proc.pid}/syscall").read_text().startswith("0 0x0 "):  # read(0, ...): the prompt
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and b"Aborted" not in err and b"Traceback" not in err, err


# --- a Pipeline dropped without close() ---------------------------------------------------------


def host_pids() -> set[int]:
    """This process's draft host children (the resource tracker is a child too, and stays)."""
    out = set()
    for pid in children(os.getpid()):
        try:
            if b"host" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.add(pid)
        except OSError:
            pass
    return out


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_dropped_pipeline_stops_its_draft_host_and_unlinks_its_rings(shm_made):
    before = host_pids()
    for _ in range(2):
        p = mirror_mlx.load()
        p.generate("Once upon a time", max_tokens=8, mode="mirror")
        hosts = host_pids() - before
        assert hosts and shm_made
        p = None
        gc.collect()
        deadline = time.monotonic() + 10
        while host_pids() - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host_pids() - before, "the draft host outlived its dropped Pipeline"
        assert leaks.leaked(shm_made) == [], "the dropped Pipeline left its rings behind"


# --- user callbacks -------------------------------------------------------------------------------


class Boom(Exception):
    """What a user's callback raised."""


@pytest.mark.parametrize("mode", ["mirror", "sd", "ar"])
def test_a_user_callback_that_raises_reaches_the_caller_and_the_draft_stays_in_step(pipe, mode):
    calls = [0]

    def fails_on_the_third_step(tokens, logits):
        calls[0] += 1
        if calls[0] == 3:
            raise Boom("the user's processor failed")
        return logits

    knobs = dict(kappa=2, gamma=3, exit_layer=2) if mode == "mirror" else dict(gamma=3) if mode == "sd" else {}
    reference = pipe.generate("Once upon a time", max_tokens=24, mode="ar").tokens
    with pytest.raises(Boom):
        pipe.generate("Once upon a time", max_tokens=24, mode=mode, logits_processors=[fails_on_the_third_step], **knobs)
    for again in ("mirror", "sd"):  # the draft answers the next calls in step: no failure, no fallback to ar
        out = pipe.generate("Once upon a time", max_tokens=24, mode=again,
                            **(dict(kappa=2, gamma=3, exit_layer=2) if again == "mirror" else dict(gamma=3)))
        assert_lossless(out.tokens, reference)
        assert out.stats.draft_failure is None and out.stats.mode == again


@pytest.mark.parametrize("sampler,named", [
    (lambda logprobs: mx.full((logprobs.shape[0],), -1, mx.int32), "each in [0, 512)"),
    (lambda logprobs: mx.zeros((logprobs.shape[0] + 1,), mx.int32), "one token id per row"),
    (lambda logprobs: 7, "the sampler returned a int"),
    (lambda logprobs: mx.argmax(logprobs, axis=-1).astype(mx.float32) + 0.5, "one token id per row"),
])
@pytest.mark.parametrize("mode", ["mirror", "ar"])
def test_a_sampler_that_returns_no_token_ids_is_named_and_the_draft_stays_in_step(pipe, mode, sampler, named):
    knobs = dict(kappa=2, gamma=3, exit_layer=2) if mode == "mirror" else {}
    with pytest.raises(ValueError, match="sampler") as e:
        pipe.generate("Once upon a time", max_tokens=16, mode=mode, sampler=sampler, **knobs)
    assert named in str(e.value)
    out = pipe.generate("Once upon a time", max_tokens=16, mode="mirror", kappa=2, gamma=3, exit_layer=2)
    assert out.stats.draft_failure is None and out.stats.mode == "mirror"
