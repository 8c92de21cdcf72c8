"""Serving benchmark: the pinned llama-server with native DFlash, driven through its OpenAI-compatible
`/v1/completions` at several concurrency levels (threads + urllib, standard library only).

The server never outlives us: it runs in its own process group (so one signal reaches it and any
child), the kernel kills it if this process dies (PR_SET_PDEATHSIG), an atexit hook and the
context manager's exit stop it, and SIGTERM to us becomes SystemExit so `finally` blocks run.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dflash_llama import peers


class ServerError(RuntimeError):
    """llama-server did not start, or a request to it failed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the other guards remain
        pass


class LlamaServer:
    """`with LlamaServer(target, draft, ...) as srv:` starts llama-server and waits until it answers
    /health; `srv.url` is its address. Leaving the block (normally, by an exception or Ctrl-C) stops
    it and its process group."""

    def __init__(self, target: str, draft: str | None = None, *, threads: int, n_ctx: int, n_parallel: int = 1,
                 spec_type: str = "draft-dflash", n_max: int | None = None, n_gpu_layers: int = 0,
                 startup_timeout_s: float = 120.0, extra_args: Sequence[str] = (), exe=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # -fa off, as every tool of the bench: CPU flash attention is not batch-invariant
        self.cmd = peers.server_command(target, port=self.port, threads=threads, n_ctx=n_ctx, n_parallel=n_parallel,
                                        draft=draft, spec_type=spec_type, n_max=n_max, flash_attn="off",
                                        n_gpu_layers=n_gpu_layers, extra_args=extra_args, exe=exe)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.last_pid: int | None = None  # the pid of the server once stopped, for checks
        self._log = None
        self._old_sigterm = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._log = tempfile.TemporaryFile(prefix="llama-server-", suffix=".log")
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        atexit.register(self.stop)
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise ServerError(f"llama-server did not answer /health within {self.startup_timeout_s:.0f} s:\n"
                          f"{self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        if self._log is None or self._log.closed:
            return ""
        self._log.seek(0)
        return "\n".join(self._log.read().decode("utf-8", errors="replace").strip().splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server and everything in its process group; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything the server left in its group
            except ProcessLookupError:
                pass
            proc.wait()
            self.last_pid = proc.pid
        atexit.unregister(self.stop)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


@dataclass
class Request:
    prompt_id: str
    latency_s: float
    completion_tokens: int
    text: str
    predicted_ms: float | None = None  # the server's own decode time
    draft_n: int | None = None
    draft_n_accepted: int | None = None


def complete(url: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> tuple[dict, float]:
    """One greedy /v1/completions request; returns the response and its latency in seconds."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "cache_prompt": False, "seed": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ServerError(f"/v1/completions answered {e.code}: {e.read()[:300]!r}") from e
    return out, time.perf_counter() - t0


def draft_counts(response: dict) -> tuple[int | None, int | None]:
    """(draft_n, draft_n_accepted) of one /v1/completions response: the tokens the server drafted
    for the request and how many of them its target accepted (its `timings`); None where the server
    drafted nothing (no draft model) and leaves them out."""
    t = response.get("timings") or {}
    counts = t.get("draft_n"), t.get("draft_n_accepted")
    for c in counts:
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 0):
            raise ServerError(f"the server's timings hold a draft count that is not a count: {t}")
    return counts


@dataclass
class LoadResult:
    concurrency: int
    wall_s: float
    requests: list[Request] = field(default_factory=list)

    def summary(self) -> dict:
        lat = np.array([r.latency_s for r in self.requests])
        tokens = sum(r.completion_tokens for r in self.requests)
        drafted = [r.draft_n for r in self.requests if r.draft_n is not None]
        accepted = [r.draft_n_accepted for r in self.requests if r.draft_n_accepted is not None]
        return {
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "completion_tokens": tokens,
            "wall_s": self.wall_s,
            "throughput_tokens_per_second": tokens / self.wall_s if self.wall_s > 0 else None,
            "requests_per_second": len(self.requests) / self.wall_s if self.wall_s > 0 else None,
            "latency_s": {"mean": float(lat.mean()), "p50": float(np.percentile(lat, 50)),
                          "p90": float(np.percentile(lat, 90)), "p99": float(np.percentile(lat, 99)),
                          "max": float(lat.max())},
            "acceptance_rate": (sum(accepted) / sum(drafted)) if drafted and sum(drafted) else None,
        }


def load_test(url: str, prompts: Sequence[tuple[str, str]], max_tokens: int, concurrency: int,
              on_done: Callable[[], None] | None = None) -> LoadResult:
    """Send every (id, text) prompt once with `concurrency` requests in flight."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    todo = list(enumerate(prompts))
    results: list[Request | None] = [None] * len(todo)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo or errors:
                    return
                i, (pid, text) = todo.pop(0)
            try:
                out, latency = complete(url, text, max_tokens)
                results[i] = Request(pid, latency, int(out["usage"]["completion_tokens"]), out["choices"][0]["text"],
                                     out.get("timings", {}).get("predicted_ms"), *draft_counts(out))
            except BaseException as e:  # reported in the calling thread
                with lock:
                    errors.append(e)
                return
            if on_done:
                on_done()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(todo)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return LoadResult(concurrency, wall, [r for r in results if r is not None])


def processes_of(executable: str | os.PathLike) -> list[int]:
    """PIDs of running processes whose executable is `executable` (Linux /proc)."""
    target = os.path.realpath(executable)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.path.realpath(entry / "exe") == target:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids
