"""Python API over the C++ runtime: a GGUF target and a DFlash GGUF draft, decoding together.

    rt = dflash_llama.Runtime("target.gguf", "draft.gguf", n_threads=2)
    out = rt.generate("def fib(n):", max_new_tokens=64)      # greedy: equals rt.autoregressive(...)
    out.tokens, out.text, out.steps, out.tau, out.stats
    for piece in rt.generate("def fib(n):", 64, stream=True): print(piece, end="")

Compute runs in C++ with the GIL released, always on one thread shared by every Runtime of the process (see
`_ComputeThread`); errors arrive as exceptions (ValueError for bad input).
The C++ runtime checks every value; this module only converts them to their C types (an integer out
of its C type's range is a ValueError here, never a wrap). A prompt is text (str or bytes, UTF-8: the
runtime refuses anything else) or a list of token ids.
"""

from __future__ import annotations

import codecs
import operator
import os
import queue
import threading
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .results import generation_json, plain_steps
from .schema import VARIANTS, Variant

INT32 = (-2**31, 2**31 - 1)
UINT64 = (0, 2**64 - 1)


def c_int(name: str, value, bounds: tuple[int, int] = INT32) -> int:
    """`value` as a C integer argument: an integer (not a float, not a bool) within its C type's range."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if not bounds[0] <= v <= bounds[1]:
        raise ValueError(f"{name} {v} is out of range [{bounds[0]}, {bounds[1]}]")
    return v


def text_bytes(text: str | bytes) -> bytes:
    """The bytes of a prompt for the tokenizer. Undecodable bytes of a command line (surrogate escapes)
    and lone surrogates stay as bytes, so that the runtime refuses them by name."""
    if isinstance(text, (bytes, bytearray)):
        return bytes(text)
    if not isinstance(text, str):
        raise TypeError(f"a prompt must be str, bytes or a list of token ids, got {type(text).__name__}")
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def utf8_text(text: str | bytes) -> str:
    """A prompt as str for a Python tokenizer, refused as the C++ runtime refuses it when not UTF-8."""
    data = text_bytes(text)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the prompt is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


@dataclass
class Step:
    drafted: list[int]  # drafted tokens the target verified
    accepted: int  # how many of them the target agreed with
    produced: int  # tokens the step added (accepted + 1, fewer at a stop)
    source: str = "draft"  # where `drafted` came from: "draft", "ngram" (the adaptive loop's n-gram source) or "plain"


@dataclass
class Stats:
    n_prompt: int
    n_generated: int
    t_prefill_ms: float
    t_draft_ms: float
    t_verify_ms: float
    t_other_ms: float
    t_total_ms: float
    tokens_per_second: float  # generation only, prefill excluded


@dataclass
class Policy:
    """What the adaptive loop (`draft_max="auto"`) chose: N = 0 steps are plain decodes."""

    plain_steps: int
    draft_steps: int
    probes: int  # probes of drafting from plain mode (drafting steps, or shadow probes)
    mean_draft: float  # mean N over the drafting steps
    plain_share: float
    predicted_tokens_per_second: float  # the loop's own cost model, over its choices
    shadow_probes: int = 0  # probes that were draft forwards scored by the plain steps after them
    calibration_ms: float = 0.0  # the step costs measured before this generation (once per Runtime)
    ngram_steps: int = 0  # steps that verified an n-gram proposal (no draft forward)
    ngram_drafted: int = 0  # n-gram tokens verified
    ngram_accepted: int = 0  # of them accepted
    draft_tau: float = 0.0  # tokens a drafting step produced on average
    # the confidence gate (a DSpark draft's confidence head): slots it cut, and over the drafts it let
    # through, what they accepted beside what the calibrated confidences and the per-position estimate expected
    confidence_steps: int = 0
    confidence_cut: int = 0
    confidence_expected: float = 0.0
    position_expected: float = 0.0
    confidence_accepted: int = 0

    @property
    def ngram_acceptance(self) -> float:
        return self.ngram_accepted / self.ngram_drafted if self.ngram_drafted else 0.0

    def steps_line(self) -> str:
        """How many steps each source won and what it accepted: "40 plain, 12 draft (tau 2.10), 30 n-gram
        (acc 0.71)"."""
        return (f"{self.plain_steps} plain, {self.draft_steps} draft (tau {self.draft_tau:.2f}), "
                f"{self.ngram_steps} n-gram (acc {self.ngram_acceptance:.2f})")

    def confidence_line(self) -> str | None:
        """The confidence gate in one line, None when it never ran."""
        if not (self.confidence_steps or self.confidence_cut):
            return None
        return (f"{self.confidence_cut} slots cut; over {self.confidence_steps} verified drafts, accepted "
                f"{self.confidence_accepted}, expected {self.confidence_expected:.1f} by the calibrated confidences, "
                f"{self.position_expected:.1f} by position")


@dataclass
class Threads:
    """The CPU threads that decoded: as given (n_threads; 0 or -1: all), or measured (n_threads None): a plain
    decode at each count in `counts`, the fastest kept, measured again after a generation whose plain
    steps ran 1.5x slower than that."""

    n_threads: int
    measured: bool
    counts: list[int]
    plain_ms: list[float]
    measurements: int = 0
    batch_rows: int = 0  # with a draft: the rows of a verify of its block, timed at each count too
    batch_ms: list[float] = field(default_factory=list)

    def cost(self, i: int) -> float:
        """What count i is judged by: a plain step plus a verified token's share of a verify."""
        return self.plain_ms[i] + (self.batch_ms[i] / self.batch_rows if self.batch_rows else 0.0)

    def line(self) -> str:
        """'1 (measured 6.1 ms vs 9.8 ms at 2; a verify of 8: 41.8 ms vs 60.2 ms at 2)'."""
        if not self.measured:
            return f"{self.n_threads} (as given)"

        def times(ms_list: list[float]) -> str:
            mine = [f" {ms:.1f} ms" for c, ms in zip(self.counts, ms_list) if c == self.n_threads]
            others = [f" vs {ms:.1f} ms at {c}" for c, ms in zip(self.counts, ms_list) if c != self.n_threads]
            return "".join(mine + others)

        batch = f"; a verify of {self.batch_rows}:{times(self.batch_ms)}" if self.batch_rows else ""
        again = f"; {self.measurements} measurements" if self.measurements > 1 else ""
        return f"{self.n_threads} (measured{times(self.plain_ms)}{batch}{again})"


@dataclass
class Generation:
    tokens: list[int]  # generated ids, prompt excluded
    text: str
    steps: list[Step]  # one per target verify; empty for autoregressive decoding
    tau: float  # mean tokens produced per verify (0 for autoregressive)
    stop_reason: str  # "max_tokens", "stop_token" or "context_full"
    acceptance_by_position: list[float]
    stats: Stats
    policy: Policy | None = None  # the adaptive loop's choices; None for a fixed draft length
    threads: Threads | None = None  # the CPU threads that decoded (None: batched decoding)

    def to_json(self, prompt_ids: Sequence[int] | None = None) -> dict:
        """The `dflash-llama generate --json` object (`results.generation_json`). Plain decoding
        (no steps after the first token) is written as the reference writes it: one step per decode."""
        if self.steps or len(self.tokens) <= 1:
            steps, tau = [{k: v for k, v in asdict(s).items() if k != "source"} for s in self.steps], self.tau
        else:
            steps, tau = plain_steps(len(self.tokens)), None
        extra = {} if self.policy is None else {"policy": asdict(self.policy)}
        if self.threads is not None and self.threads.measured:
            extra["threads"] = asdict(self.threads)
        return generation_json(self.tokens, self.text, steps, tau, stop_reason=self.stop_reason,
                               acceptance_by_position=self.acceptance_by_position, stats=asdict(self.stats),
                               prompt_ids=prompt_ids, **extra)


def _policy(p) -> Policy:
    return Policy(p.plain_steps, p.draft_steps, p.probes, p.mean_draft, p.plain_share, p.predicted_tokens_per_second,
                  p.shadow_probes, p.calibration_ms, p.ngram_steps, p.ngram_drafted, p.ngram_accepted, p.draft_tau,
                  p.confidence_steps, p.confidence_cut, p.confidence_expected, p.position_expected,
                  p.confidence_accepted)


class _ComputeThread:
    """The one thread every Runtime of the process computes on, streaming or not, one job at a time.

    ggml's CPU backend runs a graph on an OpenMP team of the calling thread. Each calling thread has
    its own team, and once one thread's team exists, a graph run from another thread measured half
    the speed on a 2-core machine (SmolLM2 decoding: 93 tok/s from the thread that computed before,
    57 from a fresh thread; with a compute thread per Runtime, a second Runtime at -t 2 decoded at
    98 tok/s where one alone did 179). Streaming needs a thread besides the caller's, so every
    compute goes to this one, shared by all Runtimes: their jobs run in the order they came."""

    def __init__(self):
        self._start()

    def _start(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(self._jobs,), daemon=True,
                                        name="dflash-llama-compute")
        self._thread.start()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:  # holds no reference to the Runtime
        while (job := jobs.get()) is not None:
            _ComputeThread._run(*job)
            del job  # nothing of a finished job stays alive in this thread

    @staticmethod
    def _run(fn, done: threading.Event, box: list) -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller
            box.append((False, e))
        finally:
            done.set()

    def submit(self, fn) -> tuple[threading.Event, list]:
        """Queue `fn`; the event is set once `box` holds (ok, result or exception)."""
        if not self._thread.is_alive():  # a forked child has no copy of the thread: a new one
            self._start()
        done, box = threading.Event(), []
        self._jobs.put((fn, done, box))
        return done, box

    def call(self, fn):
        """fn() on the compute thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        done, box = self.submit(fn)
        interrupted = None
        while not done.is_set():  # a native call cannot stop midway: Ctrl-C takes effect once it returns
            try:
                done.wait()
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
        ok, value = box[0]
        if not ok:
            raise value
        return value



_shared_compute: _ComputeThread | None = None
_shared_compute_lock = threading.Lock()


def _compute_thread() -> _ComputeThread:
    """The process's compute thread, started at the first Runtime."""
    global _shared_compute
    with _shared_compute_lock:
        if _shared_compute is None:
            _shared_compute = _ComputeThread()
        return _shared_compute


@dataclass
class Stream:
    """Iterator of text pieces; `.result` holds the Generation once the iterator is exhausted."""

    _pieces: Iterator[str]
    result: Generation | None = field(default=None)

    def __iter__(self) -> Iterator[str]:
        return self._pieces


class Runtime:
    def __init__(self, target: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                 n_threads: int | None = None, n_ctx: int = 4096, n_batch: int = 512, n_gpu_layers: int = 0,
                 kv_f32: bool = False, n_seq: int = 1, compact_draft_head: bool = True, verbose: bool = False,
                 own_head: bool = True, huge_pages: bool = True):
        """n_threads: CPU threads (0 or -1: all); None (default): measured before the first generation, the
        fastest of 1, 2 and all for a plain decode and (with a draft) a verify of its block, and again when
        decoding slows down.
        kv_f32: keep the target's KV cache in f32 (llama.cpp's default is f16), for parity runs.
        n_seq: sequences `autoregressive_batch` decodes side by side (n_ctx is per sequence).
        compact_draft_head: the draft proposes through a Q4_0 copy of the target's output head (made at
        load, when the target's is larger): a cheaper draft step, the same exact output. False: the
        target's own head, as the reference computes it (for comparisons of drafted tokens).
        own_head: compute the target's output head ourselves, for the logits rows a step reads (a verify
        stops at its first rejection), where its graph ends in one matmul of its final norm and our
        logits equal llama.cpp's bit for bit (checked at the first decode); else llama.cpp's.
        False: always llama.cpp's (for comparisons).
        huge_pages: read the target's weights into memory and back it with huge pages where the kernel
        can (Linux 6.1+; `huge_page_bytes` says how much): a decode streams every weight each step, and
        fewer, larger pages make that cheaper. False: llama.cpp's mmap of the file, as its tools load."""
        try:
            from . import _core
        except ImportError as e:
            raise RuntimeError(f"the native runtime (dflash_llama._core) is not built: {e}; build it with "
                               "./setup.sh (or pip install --no-build-isolation -e .)") from e

        self._engine = _core.Engine(os.fspath(target), os.fspath(draft) if draft else "",
                                    c_int("n_threads", 0 if n_threads is None else n_threads), c_int("n_ctx", n_ctx),
                                    c_int("n_batch", n_batch), c_int("n_gpu_layers", n_gpu_layers), bool(kv_f32),
                                    c_int("n_seq", n_seq), bool(compact_draft_head), bool(verbose),
                                    measure_threads=n_threads is None, own_head=bool(own_head),
                                    huge_pages=bool(huge_pages))
        self._core = _core
        self._compute = _compute_thread()  # every graph of every Runtime runs there, one job at a time

    # -- properties -------------------------------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return self._engine.has_draft

    @property
    def output_head(self) -> str | None:
        """Whose output head computes the target's logits: "ours" (output_head.h), "llama.cpp", or None
        before the first decode has shown which."""
        return self._engine.output_head or None

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the target's weights in huge pages (0: none: huge_pages=False, or not supported here)."""
        return self._engine.huge_page_bytes

    @property
    def compact_draft_head(self) -> bool:
        """Whether the draft proposes through a Q4_0 copy of the target's head."""
        return self._engine.compact_draft_head

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._engine.n_vocab

    @property
    def n_embd(self) -> int:
        return self._engine.n_embd

    @property
    def n_layer(self) -> int:
        return self._engine.n_layer

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def draft_variant(self) -> Variant:
        """The draft's kind (`schema.VARIANTS`): DFLASH1, DFLASH2 (convolutions + candidate selector) or
        DSPARK (Markov head, optionally a confidence head)."""
        return VARIANTS[self._engine.draft_variant]

    @property
    def sample_from_anchor(self) -> bool:
        """The draft's block layout: anchor-first (B inputs draft B tokens), else DFlash's (B - 1)."""
        return self._engine.sample_from_anchor

    @property
    def has_confidence_head(self) -> bool:
        """Whether the draft has a confidence head (DSpark): what `draft_p_min` reads."""
        return self._engine.has_confidence_head

    @property
    def max_draft(self) -> int:
        """The most tokens one step drafts at the draft's block size: B anchor-first, else B - 1."""
        return self.block_size - (0 if self.sample_from_anchor else 1)

    @property
    def mask_token_id(self) -> int:
        return self._engine.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self._engine.target_layer_ids)

    # -- text ---------------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True) -> list[int]:
        """Token ids of UTF-8 text (str or bytes); ValueError names the first byte that is not UTF-8."""
        return list(self._engine.tokenize(text_bytes(text), bool(add_special)))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._engine.detokenize(list(tokens)).decode("utf-8", errors="replace")

    # -- decoding -----------------------------------------------------------------------------
    def generate(self, prompt: str | bytes | Sequence[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, block_size: int | None = None,
                 draft_max: int | str | None = "auto", ngram: bool | None = None, stop_tokens: Sequence[int] = (),
                 stop_at_eog: bool = True, stream: bool = False, draft_p_min: float = 0.0,
                 confidence: bool | None = None) -> Generation | Stream:
        """DFlash speculative decoding. Greedy (temperature 0) output equals `autoregressive`.

        draft_max: "auto" lets each step choose what to verify for the highest expected speed: nothing
        (a plain decode), N drafted tokens, or an n-gram continuation of the text so far; N verifies at
        most N drafted tokens every step; None the whole block (`max_draft` tokens).
        ngram: the adaptive loop's n-gram source (None: on with "auto"; True with a fixed draft length
        is a ValueError).
        draft_p_min: a draft with a confidence head (DSpark) stops each draft before its first slot whose
        confidence is below it (0: never; llama.cpp's --spec-draft-p-min); a ValueError for other drafts.
        confidence: the adaptive loop's confidence gate, which cuts each draft where its calibrated
        confidences stop paying (None: on where the draft has a confidence head; True without one, or
        with a fixed draft length, is a ValueError)."""
        if not self.has_draft:
            raise ValueError("this Runtime has no draft: pass draft=..., or use autoregressive()")
        params = self._params(max_new_tokens, temperature, top_p, top_k, seed, block_size, draft_max,
                              stop_tokens, stop_at_eog)
        params.ngram = None if ngram is None else bool(ngram)
        params.draft_p_min = float(draft_p_min)
        params.confidence = None if confidence is None else bool(confidence)
        return self._run(self._engine.generate, prompt, params, stream)

    def forget_policy(self) -> None:
        """The adaptive loop carries what it learned from one generation to the next of this Runtime
        (per block size: acceptance by position and by n-gram class, its costs as it kept them, the
        waits between probes). This drops it: the next generation starts as a new Runtime's first
        would (the step costs measured before the first generation are kept)."""
        self._compute.call(self._engine.forget_policy)

    def remeasure_threads(self) -> None:
        """Measure the thread count again before the next generation, as the Runtime does itself when
        its plain steps drift slower than measured (no-op when n_threads was given). What the adaptive
        loop learned is kept if the same count wins, and dropped (step costs measured again) if another
        does."""
        self._compute.call(self._engine.remeasure_threads)

    def step_costs(self, block_size: int | None = None) -> dict | None:
        """What the adaptive loop measured on this machine before its first generation at this block
        size (default: the draft's): `verify_ms[k]`, one target decode of k tokens (k = 1: a plain
        step), `draft_ms[n]`, a draft step of n proposals (a block of n + 1 positions, with the
        injection of a step's two tokens), 0.0 for sizes it interpolates; and the runtime's own output
        head after a verify: a batch of r logits rows costs `head_pass_ms` + r * `head_row_ms` (both 0.0
        where llama.cpp's head computes every row inside the decode, which verify_ms then includes).
        None before that generation."""
        bs = self.block_size if block_size is None else c_int("block_size", block_size)
        costs = self._compute.call(lambda: self._engine.step_costs(bs))
        if costs is None:
            return None
        verify, draft, head_row, head_pass = costs
        return {"block_size": bs, "verify_ms": list(verify), "draft_ms": list(draft), "head_row_ms": head_row,
                "head_pass_ms": head_pass}

    def autoregressive(self, prompt: str | bytes | Sequence[int], max_new_tokens: int = 128, *,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                       stop_tokens: Sequence[int] = (), stop_at_eog: bool = True,
                       stream: bool = False) -> Generation | Stream:
        """Plain target decoding, one token per target decode."""
        params = self._params(max_new_tokens, temperature, top_p, top_k, seed, None, None,
                              stop_tokens, stop_at_eog)
        return self._run(self._engine.autoregressive, prompt, params, stream)

    def autoregressive_batch(self, prompts: Sequence[str | bytes | Sequence[int]], max_new_tokens: int = 128, *,
                             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                             stop_tokens: Sequence[int] = (), stop_at_eog: bool = True) -> list[Generation]:
        """Plain decoding of many prompts, `n_seq` at a time in one target decode (dataset building).

        Greedy results equal `autoregressive` prompt by prompt; prompt i samples with seed + i."""
        params = self._params(max_new_tokens, temperature, top_p, top_k, seed, None, None,
                              stop_tokens, stop_at_eog)
        token_lists = [self._prompt_tokens(p) for p in prompts]
        results = self._compute.call(lambda: self._engine.autoregressive_batch(token_lists, params))
        return [self._generation(r) for r in results]

    def capture(self, tokens: Sequence[int], layer_ids: Sequence[int] | None = None) -> np.ndarray:
        """Target features of `tokens`: float32 [n_tokens, n_taps * n_embd], taps concatenated.

        layer_ids are Hugging Face ids (hidden_states[id + 1]); default: the draft's target layers.
        """
        ids = [c_int("layer id", i) for i in layer_ids] if layer_ids is not None else self.target_layer_ids
        tokens = self._check_tokens(tokens)
        return self._compute.call(lambda: self._engine.capture(tokens, ids))

    def target_logits(self, tokens: Sequence[int], one_at_a_time: bool = False,
                      n_prefill: int = 1) -> np.ndarray:
        """Target logits of every token, float32 [n_tokens, n_vocab]: from one batched decode (as a
        verify computes them), or one token at a time after a batched prefill of `n_prefill`
        tokens (as autoregressive decoding computes them)."""
        tokens, n_prefill = self._check_tokens(tokens), c_int("n_prefill", n_prefill)
        return self._compute.call(lambda: self._engine.target_logits(tokens, bool(one_at_a_time), n_prefill))

    def trace_draft(self, features: np.ndarray, block: Sequence[int]) -> dict[str, np.ndarray]:
        """Every named draft intermediate (float32, NumPy order) for context `features`
        ([n_ctx_tokens, n_taps * n_embd], at positions 0..) and a `block` at the next positions.
        `result_output` is the raw head output of every block position: [B, n_vocab], through the target's
        own head (as the reference computes it; generation with `compact_draft_head` proposes through its
        Q4_0 copy, so its drafts may differ where logits are close). A DFlash 2
        draft adds its convolutions' (`attn_conv_dyn-N` [B, 2*K*groups], `attn_conv_in-N`,
        `attn_conv_out-N`, `ffn_conv_*-N` [B, n_embd]) and its selector's greedy walk from `block[0]`
        over the n = B - 1 drafted slots: `selector_gate` [n, rank], `selector_unary` and
        `selector_candidates` [n, K] (ordered by unary descending, ties by smaller id),
        `selector_scores` [n, K, K] (slot, predecessor index, candidate index) and `selector_path` [n]."""
        feats = np.ascontiguousarray(features, dtype=np.float32)
        if feats.ndim != 2:
            raise ValueError(f"features must be 2-D [n_tokens, n_taps * n_embd], got shape {feats.shape}")
        block = self._check_tokens(block)
        return dict(self._compute.call(lambda: self._engine.trace_draft(feats, block)))

    # -- internals ----------------------------------------------------------------------------
    def _params(self, max_new_tokens, temperature, top_p, top_k, seed, block_size, draft_max,
                stop_tokens, stop_at_eog):
        """The C++ request, its values converted to their C types; the runtime checks them (check_request
        and friends, ValueError here). None leaves block_size and draft_max to the draft; draft_max
        "auto" is the adaptive loop."""
        p = self._core.GenerateParams()
        p.max_new_tokens = c_int("max_new_tokens", max_new_tokens)
        p.temperature = float(temperature)
        p.top_p = float(top_p)
        p.top_k = c_int("top_k", top_k)
        if operator.index(seed) < 0:  # the C type is unsigned
            raise ValueError(f"seed must be >= 0, got {seed}")
        p.seed = c_int("seed", seed, UINT64)
        p.block_size = None if block_size is None else c_int("block_size", block_size)
        if isinstance(draft_max, str) and draft_max != "auto":
            raise ValueError(f"draft_max must be an integer, None or 'auto', got {draft_max!r}")
        p.adaptive = draft_max == "auto"
        p.draft_max = None if draft_max is None or p.adaptive else c_int("draft_max", draft_max)
        p.stop_tokens = [c_int("stop token", t) for t in stop_tokens]
        p.stop_at_eog = bool(stop_at_eog)
        return p

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        tokens = [operator.index(t) for t in tokens]  # the vocabulary bounds them below 2**31
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"token {bad[0]} is outside the vocabulary of {self.n_vocab} tokens")
        return tokens

    def _prompt_tokens(self, prompt: str | bytes | Sequence[int]) -> list[int]:
        if isinstance(prompt, (str, bytes, bytearray)):  # bytes are text, never token ids
            return self.tokenize(prompt)
        return self._check_tokens(prompt)

    def _generation(self, r) -> Generation:
        s = r.stats
        return Generation(
            tokens=list(r.tokens),
            text=self.detokenize(r.tokens),
            steps=[Step(list(x.drafted), x.accepted, x.produced, x.source) for x in r.steps],
            tau=r.tau,
            stop_reason=r.stop_reason,
            acceptance_by_position=list(r.acceptance_by_position),
            stats=Stats(s.n_prompt, s.n_generated, s.t_prefill_ms, s.t_draft_ms, s.t_verify_ms,
                        s.t_other_ms, s.t_total_ms, s.tokens_per_second),
            policy=_policy(r.policy) if r.adaptive else None,
            threads=Threads(r.threads.n_threads, r.threads.measured, list(r.threads.counts), list(r.threads.plain_ms),
                            measurements=r.threads.measurements, batch_rows=r.threads.batch_rows,
                            batch_ms=list(r.threads.batch_ms)) if r.threads.n_threads > 0 else None,
        )

    def _run(self, fn, prompt, params, stream: bool):
        tokens = self._prompt_tokens(prompt)
        if not stream:
            return self._generation(self._compute.call(lambda: fn(tokens, params, None)))
        return self._stream(fn, tokens, params)

    def _stream(self, fn, tokens, params) -> Stream:
        pieces: queue.Queue = queue.Queue()
        done = object()
        out = Stream(iter(()))

        def job():
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            try:
                r = fn(tokens, params,
                       lambda new: pieces.put(decoder.decode(b"".join(self._engine.piece(t) for t in new))))
                out.result = self._generation(r)
                pieces.put(decoder.decode(b"", final=True))
                pieces.put(done)
            except BaseException as e:  # surfaced in the consumer's thread
                pieces.put(e)

        def iterate() -> Iterator[str]:
            self._compute.submit(job)  # runs once the jobs before it are done
            while True:
                item = pieces.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item:
                    yield item

        out._pieces = iterate()
        return out
