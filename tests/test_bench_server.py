"""Serving mode on loopback: llama-server with native DFlash answers at several concurrency levels
with the greedy text of llama-completion, and never outlives us (normal exit, exception, failed
start, SIGINT, SIGTERM, SIGKILL of the parent)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_llama import paths, peers
from dflash_llama.bench import server
from dflash_llama.bench.runner import text_matches

pytestmark = pytest.mark.peer

PROMPTS = [("p0", "def add(a, b):\n"), ("p1", "The capital of France is"), ("p2", "import os\n"),
           ("p3", "x = [1, 2, 3]\n")]


def alive(pid: int) -> bool:
    """True while `pid` is a running process (a zombie counts as gone: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def servers_running() -> list[int]:
    return [p for p in server.processes_of(paths.tool("llama-server")) if alive(p)]


def test_end_to_end_on_loopback(tiny_target_gguf, tiny_draft_gguf):
    before = set(servers_running())
    with server.LlamaServer(tiny_target_gguf, tiny_draft_gguf, threads=1, n_ctx=256, n_parallel=3, n_max=3) as srv:
        pid = srv.pid
        assert srv.url.startswith("http://127.0.0.1:") and pid in servers_running()
        levels = {c: server.load_test(srv.url, PROMPTS, 10, c) for c in (1, 3)}
    assert wait_gone(pid, 1.0) and set(servers_running()) == before

    for c, res in levels.items():
        s = res.summary()
        assert (s["concurrency"], s["requests"], s["completion_tokens"]) == (c, 4, 40)
        assert s["latency_s"]["p50"] <= s["latency_s"]["p90"] <= s["latency_s"]["max"]
        assert [r.prompt_id for r in res.requests] == ["p0", "p1", "p2", "p3"]
        assert all(r.draft_n is not None and r.draft_n > 0 for r in res.requests)  # native DFlash drafted
    # greedy: every level answers llama-completion's text
    for pid_, text in PROMPTS:
        ref = peers.completion(str(tiny_target_gguf), text, 10, threads=1, n_ctx=256)
        for res in levels.values():
            got = next(r.text for r in res.requests if r.prompt_id == pid_)
            assert text_matches(got, ref.text, ref.stopped)[0], (pid_, got, ref.text)


def test_exception_inside_stops_the_server(tiny_target_gguf, tiny_draft_gguf):
    with pytest.raises(RuntimeError, match="boom"):
        with server.LlamaServer(tiny_target_gguf, tiny_draft_gguf, threads=1, n_ctx=128, n_max=3) as srv:
            pid = srv.pid
            raise RuntimeError("boom")
    assert wait_gone(pid, 1.0)
    srv.stop()  # idempotent


def test_failed_start_names_the_reason_and_leaves_nothing(tmp_path, tiny_draft_gguf):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"nonsense")
    before = set(servers_running())
    srv = server.LlamaServer(bad, tiny_draft_gguf, threads=1, n_ctx=128)
    with pytest.raises(server.ServerError, match="llama-server exited with"):
        srv.start()
    assert srv.proc is None and set(servers_running()) == before


def test_load_test_reports_request_errors(tiny_target_gguf):
    with server.LlamaServer(tiny_target_gguf, None, threads=1, n_ctx=64) as srv:
        pid = srv.pid
        with pytest.raises(server.ServerError, match="answered 400"):  # a prompt longer than the context
            server.load_test(srv.url, [("long", "word " * 400)], 8, 1)
    assert wait_gone(pid, 1.0)


# A child that takes Ctrl-C as a terminal program does: a shell starts background jobs with SIGINT
# ignored, and Python keeps an inherited "ignore", so under `cmd &` the child would never see it.
CHILD = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from dflash_llama.bench import server
    with server.LlamaServer(sys.argv[1], sys.argv[2], threads=1, n_ctx=128, n_max=3) as srv:
        print(srv.pid, flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "term", "kill"])
def test_no_server_outlives_its_parent(sig, tiny_target_gguf, tiny_draft_gguf):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_target_gguf), str(tiny_draft_gguf)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"the child did not start a server: {line!r}"
        pid = int(line)
        assert alive(pid)
        child.send_signal(sig)
        child.wait(timeout=30)
        assert wait_gone(pid), f"llama-server {pid} outlived its parent after {sig.name}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
