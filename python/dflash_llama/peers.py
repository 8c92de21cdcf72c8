"""The pinned llama.cpp tools as peers, the one module that runs them: plain decoding
(`llama-completion`), native DFlash and n-gram speculation (`llama-speculative-simple --spec-type
...`), serving (`llama-server`'s command line; bench/server.py runs it) and quantisation
(`llama-quantize`). Each run is one subprocess whose text and timings are parsed from what the tool
prints; flags are parameters, one parser per tool.

The decoding tools get the prompt through `-p` with `--no-escape` (`-f` drops a trailing newline,
and escape processing would rewrite backslashes in code prompts), greedy sampling, the caller's
threads and context, and `-fa off` unless the caller says otherwise: on the CPU, flash attention
makes a token's logits depend on how its batch was split once the cache passes 256 cells, which no
exact speculative decoder can afford (our runtime runs without it).

What the tools print, and how it is read:
- llama-completion (`--no-display-prompt`): stdout is the generated text, then " [end of text]\n"
  if it stopped at an end-of-generation token, then "\n\n". Speed: its `eval time = X ms / R runs`
  (one run per token after the first, the first comes from the prompt's logits).
- llama-speculative-simple: stdout is "\n\n", the prompt, the generated text, "\n\n" after the
  loop and "\n\n" once more at exit. Speed: its
  `decoded N tokens in T seconds` (the prompt's last token is decoded with the first verify, so
  T covers all N tokens). It stops only once it has passed -n, and native DFlash keeps drafting
  its full n_max near the end, so it decodes 1 to n_max+1 tokens past -n: texts are compared as
  prefixes (`bench.runner.text_matches`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from . import paths

# the spec types of the pinned common/speculative.cpp that need no draft model
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

END_OF_TEXT = " [end of text]\n"


class PeerError(RuntimeError):
    """A peer tool failed or printed something we cannot read."""


@dataclass
class ToolRun:
    """One finished run of a tool, whatever its exit status."""
    command: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def log_tail(self) -> str:
        """The lines that say why a run failed (its asserts and errors), else the log's last lines."""
        lines = (self.stderr or self.stdout).strip().splitlines()
        failed = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower()]
        return "\n".join(failed[-3:] if not self.ok and failed else lines[-8:])


@dataclass
class PeerResult:
    text: str  # generated text, prompt excluded
    n_tokens: int  # tokens the tool generated (its own count)
    decode_ms: float  # time of the generation phase
    prompt_ms: float | None  # time of the prompt phase
    stopped: bool  # ended at an end-of-generation token
    n_drafted: int | None = None  # speculative tools: drafted tokens sent to the target
    n_accept: int | None = None  # ... and accepted by it
    n_threads: int | None = None  # the threads it decoded with (its own report)
    command: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float | None:
        return 1000.0 * self.n_tokens / self.decode_ms if self.decode_ms > 0 else None

    @property
    def tau(self) -> float:
        """Speculative tools: tokens per target decode; each decode produces its accepted drafts plus one."""
        n_decodes = self.n_tokens - (self.n_accept or 0)
        return self.n_tokens / n_decodes if n_decodes > 0 else 0.0


def _number(pattern: str, text: str, what: str, tool: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise PeerError(f"{tool}: could not find {what} in its output")
    return float(m.group(1))


def parse_completion(stdout: str, stderr: str) -> PeerResult:
    """Read llama-completion's output (run with --no-display-prompt)."""
    tool = "llama-completion"
    if not stdout.endswith("\n\n"):
        raise PeerError(f"{tool}: output does not end with the blank line it prints last: {stdout[-80:]!r}")
    text = stdout[:-2]
    stopped = text.endswith(END_OF_TEXT)
    if stopped:
        text = text[: -len(END_OF_TEXT)]
    eval_ms = _number(r"common_perf_print:\s+eval time =\s+([\d.]+) ms", stderr, "the eval time", tool)
    runs = int(_number(r"common_perf_print:\s+eval time =\s+[\d.]+ ms /\s+(\d+) runs", stderr, "the eval runs", tool))
    prompt_ms = _number(r"prompt eval time =\s+([\d.]+) ms", stderr, "the prompt eval time", tool)
    threads = re.search(r"system_info: n_threads = (\d+)", stderr)
    # the first token comes from the prompt's logits, every later one from one eval run
    return PeerResult(text=text, n_tokens=runs, decode_ms=eval_ms, prompt_ms=prompt_ms, stopped=stopped,
                      n_threads=int(threads.group(1)) if threads else None)


def parse_speculative(stdout: str, stderr: str, prompt: str, n_predict: int) -> PeerResult:
    """Read llama-speculative-simple's output; `prompt` is the text it echoes before generating,
    `n_predict` the -n it was given (it only stops short of passing -n at end of generation)."""
    tool = "llama-speculative-simple"
    start = stdout.find(prompt)
    if start < 0 or not stdout.endswith("\n\n\n\n"):
        raise PeerError(f"{tool}: output does not hold the echoed prompt and the two final blank lines")
    text = stdout[start + len(prompt): -4]
    n_tokens = int(_number(r"decoded\s+(\d+) tokens in", stderr, "the decoded token count", tool))
    decode_s = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr, "the decode time", tool)
    encode_s = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr, "the encode time", tool)
    n_drafted = int(_number(r"n_drafted = (\d+)", stderr, "n_drafted", tool))
    n_accept = int(_number(r"n_accept  = (\d+)", stderr, "n_accept", tool))
    return PeerResult(text=text, n_tokens=n_tokens, decode_ms=1000.0 * decode_s, prompt_ms=1000.0 * encode_s,
                      stopped=n_tokens <= n_predict, n_drafted=n_drafted, n_accept=n_accept)


def run_tool(cmd: Sequence[str], timeout_s: float = 600.0) -> ToolRun:
    """Run a tool to its end; a failing exit status is the caller's to judge, a timeout is an error."""
    cmd = [str(c) for c in cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise PeerError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f} s") from e
    return ToolRun(cmd, r.returncode, r.stdout.decode("utf-8", errors="replace"),
                   r.stderr.decode("utf-8", errors="replace"))


def _checked(cmd: Sequence[str], timeout_s: float) -> ToolRun:
    run = run_tool(cmd, timeout_s)
    if not run.ok:
        raise PeerError(f"{Path(run.command[0]).name} exited with {run.returncode}:\n{run.log_tail()}")
    return run


def gpu_flags(n_gpu_layers: int, *, draft: bool = False) -> list[str]:
    """`-ngl N` (and `-ngld` for a draft) as our runtime offloads: N target layers (-1: all). Given
    only to a GPU build (whose tools would otherwise offload everything by default); a CPU build
    gets none, and ValueError for N != 0."""
    from dflash_llama import _core, supports_gpu_offload

    if not supports_gpu_offload():
        if n_gpu_layers:
            raise ValueError(f"-ngl {n_gpu_layers}: {_core.NO_GPU_BACKEND}")
        return []
    n = "all" if n_gpu_layers < 0 else str(n_gpu_layers)
    return ["-ngl", n, *(["-ngld", n] if draft else [])]


def _thread_flags(threads: int | None, *names: str) -> list[str]:
    """`-t N -tb N` (or the draft's `-td N -tbd N`); none for threads None: the tool's default count."""
    return [] if threads is None else [x for name in names for x in (name, str(threads))]


def _decoding_flags(target, prompt: str, n_predict: int, threads: int | None, n_ctx: int,
                    flash_attn: str, n_gpu_layers: int = 0, draft: bool = False) -> list[str]:
    return ["-m", os.fspath(target), "-p", prompt, "--no-escape", "-n", str(n_predict),
            *_thread_flags(threads, "-t", "-tb"), "-c", str(n_ctx), "--temp", "0", "--seed", "0", "-fa", flash_attn,
            *gpu_flags(n_gpu_layers, draft=draft)]


def completion(target, prompt: str, n_predict: int, *, threads: int | None, n_ctx: int, flash_attn: str = "off",
               n_gpu_layers: int = 0, timeout_s: float = 600.0) -> PeerResult:
    """Plain greedy decoding with the pinned llama-completion (threads None: the tool's default count)."""
    cmd = [str(paths.tool("llama-completion")),
           *_decoding_flags(target, prompt, n_predict, threads, n_ctx, flash_attn, n_gpu_layers),
           "-no-cnv", "--no-display-prompt"]
    res = parse_completion(*_outputs(_checked(cmd, timeout_s)))
    res.command = cmd
    return res


def speculative_command(target, prompt: str, n_predict: int, spec_type: str, *, threads: int, n_ctx: int,
                        draft=None, n_max: int | None = None, flash_attn: str = "off",
                        n_gpu_layers: int = 0, extra_args: Sequence[str] = (), exe=None) -> list[str]:
    """The llama-speculative-simple command line (`exe`: another build of the tool, e.g. a patched one)."""
    if spec_type == "draft-dflash" and draft is None:
        raise ValueError("--spec-type draft-dflash needs a draft model")
    cmd = [str(exe or paths.tool("llama-speculative-simple")),
           *_decoding_flags(target, prompt, n_predict, threads, n_ctx, flash_attn, n_gpu_layers, draft is not None),
           "--spec-type", spec_type]
    if draft is not None:
        cmd += ["-md", os.fspath(draft), *_thread_flags(threads, "-td", "-tbd")]
    if n_max is not None:
        cmd += ["--spec-draft-n-max", str(n_max)]
    return cmd + list(extra_args)


def speculative(target, prompt: str, n_predict: int, spec_type: str, *, threads: int, n_ctx: int,
                draft=None, n_max: int | None = None, flash_attn: str = "off", n_gpu_layers: int = 0,
                extra_args: Sequence[str] = (), timeout_s: float = 600.0, exe=None) -> PeerResult:
    """Greedy speculative decoding with the pinned llama-speculative-simple (`exe`: another build of
    it, e.g. the stock one); PeerError if it fails."""
    cmd = speculative_command(target, prompt, n_predict, spec_type, threads=threads, n_ctx=n_ctx, draft=draft,
                              n_max=n_max, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, extra_args=extra_args,
                              exe=exe)
    res = parse_speculative(*_outputs(_checked(cmd, timeout_s)), prompt, n_predict)
    res.command = cmd
    return res


# ngram-simple drafts only once the sequence holds size_n + size_m + 1 tokens: with both at their
# maximum (1024) it never drafts for prompt + generation up to 2049 tokens (checked after each run)
NO_DRAFT_ARGS = ("--spec-ngram-simple-size-n", "1024", "--spec-ngram-simple-size-m", "1024")


def speculative_plain(target, prompt: str, n_predict: int, *, threads: int, n_ctx: int, n_gpu_layers: int = 0,
                      timeout_s: float = 600.0, exe=None) -> PeerResult:
    """Plain greedy decoding *inside* llama-speculative-simple: the reference its speculative runs
    must reproduce. The tool decodes the prompt without its last token, then that token with the
    first draft, and the logits of a token depend on how its batch was split (llama.cpp's batched
    kernels), so its greedy text may differ from llama-completion's at a near-tie; against this
    reference only the speculation is judged."""
    res = speculative(target, prompt, n_predict, "ngram-simple", threads=threads, n_ctx=n_ctx,
                      n_gpu_layers=n_gpu_layers, extra_args=NO_DRAFT_ARGS, timeout_s=timeout_s, exe=exe)
    if res.n_drafted:
        raise PeerError(f"llama-speculative-simple drafted {res.n_drafted} tokens in its no-draft configuration "
                        "(prompt + -n above 2049 tokens?)")
    return res


def server_command(target, *, port: int, threads: int, n_ctx: int, n_parallel: int = 1, draft=None,
                   spec_type: str = "draft-dflash", n_max: int | None = None, flash_attn: str = "off",
                   n_gpu_layers: int = 0, extra_args: Sequence[str] = (), exe=None) -> list[str]:
    """The llama-server command line on 127.0.0.1:`port`; `n_ctx` is per slot (the server splits its
    context between its `n_parallel` slots). `exe`: another build of the server (a patched one)."""
    cmd = [str(exe or paths.tool("llama-server")), "-m", os.fspath(target), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx * n_parallel), "-np", str(n_parallel),
           "--no-webui", "-fa", flash_attn, *gpu_flags(n_gpu_layers, draft=draft is not None)]
    if draft is not None:
        cmd += ["-md", os.fspath(draft), "--spec-type", spec_type, "-td", str(threads), "-tbd", str(threads)]
        if n_max is not None:
            cmd += ["--spec-draft-n-max", str(n_max)]
    return cmd + list(extra_args)


def quantize(src, dst, qtype: str, *, allow_requantize: bool = False, threads: int | None = None,
             timeout_s: float = 600.0) -> None:
    """`llama-quantize [--allow-requantize] src dst QTYPE [threads]`; PeerError with the tool's last
    lines if it fails. Without `allow_requantize` the tool refuses an already quantized `src`."""
    cmd = [str(paths.tool("llama-quantize")), *(["--allow-requantize"] if allow_requantize else []),
           os.fspath(src), os.fspath(dst), qtype.upper(), *([str(threads)] if threads else [])]
    _checked(cmd, timeout_s)


def prompt_speeds(target, sizes: Sequence[int], *, threads: int, repetitions: int = 3, n_gpu_layers: int = 0,
                  timeout_s: float = 600.0) -> dict[int, float]:
    """`llama-bench -p K,... -n 0 -fa 0 -o json`: tokens per second of a K-token prompt decode (the
    last row's logits, an empty cache), the mean of `repetitions`, for each K in `sizes`."""
    cmd = [str(paths.tool("llama-bench")), "-m", os.fspath(target), "-t", str(threads), "-fa", "0",
           "-r", str(repetitions), "-p", ",".join(str(k) for k in sizes), "-n", "0", "-o", "json",
           *gpu_flags(n_gpu_layers)]
    run = _checked(cmd, timeout_s)
    try:
        tests = json.loads(run.stdout)
        got = {int(t["n_prompt"]): float(t["avg_ts"]) for t in tests if int(t["n_gen"]) == 0}
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"llama-bench printed no JSON results ({e}):\n{run.log_tail()}") from e
    if sorted(got) != sorted(set(sizes)):
        raise PeerError(f"llama-bench measured prompt sizes {sorted(got)}, not {sorted(set(sizes))}")
    return got


def _outputs(run: ToolRun) -> tuple[str, str]:
    return run.stdout, run.stderr
