"""One benchmark run: every method on every prompt, interleaved, then the summaries.

Methods (each a row per prompt):
- `runtime-ar`: our runtime, plain decoding (`Runtime.autoregressive`), the reference for
  exactness of our speculative rows;
- `llama-completion`: the pinned llama.cpp, plain decoding;
- `llama-spec-ar`: plain decoding inside `llama-speculative-simple` (no drafts), the reference for
  the llama.cpp speculative peers (same prompt handling, so only the speculation is judged);
- `runtime-b{K}`: our DFlash runtime with verify blocks of K tokens (K-1 drafted);
- `runtime-b{B}-n{N}`: the draft's trained block B verifying only N drafted tokens (the cost
  model's pick with `--draft-max auto`);
- `runtime-auto`: our adaptive loop (`--draft-max auto`, the default) with its n-gram source, and
  `runtime-auto-no-ngram` without it (`--ngram off`); with a DSpark draft that has a confidence head,
  `runtime-auto` uses its confidence gate and `runtime-auto-no-confidence` does not;
- `native-b{K}`: llama.cpp's native DFlash, `--spec-draft-n-max K-1` (its block is n_max+1; `draft-dspark`
  for a DSpark draft, K for an anchor-first one, whose block of K drafts K);
- `chain-b{K}` (with `ngram-mod` among the n-gram types): llama.cpp's chained drafters,
  `--spec-type ngram-mod,draft-dflash` (the first that proposes wins) at `--spec-draft-n-max K-1`;
- `stock-spec-ar`, `stock-b{K}` (with native DFlash), `stock-ngram-*`, `stock-chain-b{K}` (`--stock-build`):
  the same from a stock build of the pin (ggml-cpu with llamafile's sgemm, as llama.cpp builds it by default:
  `dflash_llama.toolbuild.stock_tool`);
- `ngram-*`: llama.cpp's n-gram speculation, draft-free, with the tool's default settings.

For every prompt the methods run in an order rotated by one place from the previous prompt, so
machine noise (other jobs, thermal drift) falls on all methods alike. Ratios are taken between
rows measured in this run: per prompt (paired) and over all tokens. With a time budget, the run
stops taking new prompts when the next one and the serving phase would not fit.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from dflash_llama import peers
from dflash_llama.prompts import Prompt
from dflash_llama.results import first_mismatch

from . import cost_model

SCHEMA = "dflash-llama-bench/1"
CHAINED_NGRAM = "ngram-mod"  # the n-gram drafter llama.cpp's chain rows put before draft-dflash
REPORT_S = 20.0  # plots and report writing, reserved in the time budget


def _speed(rows: list[dict]) -> float | None:
    """Decode tokens per second over all `rows`."""
    ms = sum(r["decode_ms"] for r in rows)
    return 1000.0 * sum(r["decode_tokens"] for r in rows) / ms if ms > 0 else None


@dataclass(frozen=True)
class Method:
    key: str
    impl: str  # "dflash-llama" or "llama.cpp"
    kind: str  # "autoregressive", "dflash" or "ngram"
    block_size: int | None = None  # verify block: drafted tokens + 1
    draft_max: int | None = None  # drafted tokens verified per step (None: block_size - 1)
    spec_type: str | None = None
    auto: bool = False  # the cost model's pick
    adaptive: bool = False  # our runtime's adaptive loop (draft_max="auto"): N chosen step by step
    ngram: bool | None = None  # the adaptive loop's n-gram source (None: its default, on)
    stock: bool = False  # llama.cpp's tool from a stock build of the pin (llamafile's sgemm on)
    confidence: bool | None = None  # the adaptive loop's confidence gate (None: its default, on with a head)
    anchor_first: bool = False  # the draft's block of B drafts B tokens (else B - 1)

    @property
    def chain(self) -> bool:
        """llama.cpp's chained drafters (an n-gram type, then draft-dflash)."""
        return self.spec_type is not None and "," in self.spec_type

    @property
    def n_draft(self) -> int | None:
        if self.kind != "dflash":
            return None
        return self.draft_max if self.draft_max is not None else self.block_size - (0 if self.anchor_first else 1)

    @property
    def label(self) -> str:
        if self.key == "runtime-ar":
            return "dflash-llama autoregressive"
        if self.key == "llama-completion":
            return "llama-completion"
        if self.key == "llama-spec-ar":
            return "llama-speculative-simple, no drafts"
        if self.key == "stock-spec-ar":
            return "llama-speculative-simple, no drafts, stock build"
        if self.kind == "ngram":
            return f"llama.cpp {self.spec_type}{', stock build' if self.stock else ''}"
        who = "dflash-llama" if self.impl == "dflash-llama" else "llama.cpp native"
        if self.adaptive:
            return (f"{who} DFlash B={self.block_size}, adaptive{', no n-gram' if self.ngram is False else ''}"
                    f"{', no confidence gate' if self.confidence is False else ''}")
        if self.chain:
            return f"llama.cpp chain {self.spec_type} B={self.block_size}{', stock build' if self.stock else ''}"
        n = f", N={self.draft_max}" if self.draft_max is not None else ""
        build = ", stock build" if self.stock else ""
        return f"{who} DFlash B={self.block_size}{n}{' (auto)' if self.auto else ''}{build}"


@dataclass
class Settings:
    target: str
    draft: str
    prompts: list[Prompt]
    pilot: list[Prompt]  # prompts for the cost model's measurements
    n_predict: int
    block_sizes: list[int]
    draft_max: str | int  # "auto" or N
    threads: int
    n_ctx: int
    ngram_types: list[str]
    native: bool = True
    stock: bool = False  # llama-speculative-simple's rows from a stock build of the pin as well
    server: bool = True
    server_concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    server_prompts: int = 8  # benchmark prompts sent at each concurrency level
    patched_server: bool = False  # the serving phase's llama-server from the pinned tree + patches/series
    calibration_tokens: int = 32
    n_gpu_layers: int = 0  # target layers on the GPU, ours and the peers' alike (-1: all)
    thread_study: bool = False  # bench/thread_study.py: each tool at its default -t and every fixed one
    busy_cores: int = 1  # ... quiet and with this many cores kept busy by other processes
    thread_prompts: int = 4  # ... on this many of the benchmark prompts
    repeat: int = 1  # runs of each method on each prompt, interleaved; the fastest counts (fastest_run)
    deadline: float | None = None  # time.monotonic() by which the run must be done (None: no budget)


def text_matches(text: str, ref: str, ref_stopped: bool) -> tuple[bool, int | None]:
    """Does a peer's greedy text agree with the reference's? A reference that ran to -n is a prefix
    of the peer's text (peers may decode past -n); one that stopped at end of generation must be
    equal. Returns (exact, index of the first differing character)."""
    if ref_stopped:
        return text == ref, first_mismatch(text, ref)
    ok = text.startswith(ref)
    return ok, None if ok else first_mismatch(text, ref)


@dataclass(frozen=True)
class DraftKind:
    """What of the draft changes the plan: llama.cpp's speculative type for it, its block layout, and
    whether it has a confidence head (DSpark)."""

    native_type: str = "draft-dflash"
    anchor_first: bool = False
    confidence_head: bool = False

    @classmethod
    def of(cls, rt) -> DraftKind:
        dspark = rt.draft_variant.name == "dspark"
        return cls("draft-dspark" if dspark else "draft-dflash", rt.sample_from_anchor, rt.has_confidence_head)


def plan_methods(s: Settings, block_size: int, pick: int | None, draft: DraftKind = DraftKind()) -> list[Method]:
    af = draft.anchor_first
    methods = [Method("runtime-ar", "dflash-llama", "autoregressive"),
               Method("llama-completion", "llama.cpp", "autoregressive")]
    if s.native or s.ngram_types:
        methods.append(Method("llama-spec-ar", "llama.cpp", "autoregressive", spec_type="ngram-simple"))
    for k in s.block_sizes:
        methods.append(Method(f"runtime-b{k}", "dflash-llama", "dflash", block_size=k, anchor_first=af))
    methods.append(Method("runtime-auto", "dflash-llama", "dflash", block_size=block_size, adaptive=True,
                          anchor_first=af))
    methods.append(Method("runtime-auto-no-ngram", "dflash-llama", "dflash", block_size=block_size, adaptive=True,
                          ngram=False, anchor_first=af))
    if draft.confidence_head:
        methods.append(Method("runtime-auto-no-confidence", "dflash-llama", "dflash", block_size=block_size,
                              adaptive=True, confidence=False, anchor_first=af))
    if pick is not None and not (pick == block_size - 1 and block_size in s.block_sizes):
        methods.append(Method(f"runtime-b{block_size}-n{pick}", "dflash-llama", "dflash", block_size=block_size,
                              draft_max=pick, auto=s.draft_max == "auto", anchor_first=af))
    native_sizes = [k for k in s.block_sizes if k <= block_size]  # llama.cpp clamps n_max to the trained block
    if s.native:
        methods += [Method(f"native-b{k}", "llama.cpp", "dflash", block_size=k, spec_type=draft.native_type,
                           anchor_first=af) for k in native_sizes]
    if s.stock:  # llama-speculative-simple from a stock build, with its own no-draft reference
        methods.append(Method("stock-spec-ar", "llama.cpp", "autoregressive", spec_type="ngram-simple", stock=True))
        if s.native:
            methods += [Method(f"stock-b{k}", "llama.cpp", "dflash", block_size=k, spec_type=draft.native_type,
                               stock=True, anchor_first=af) for k in native_sizes]
    for t in s.ngram_types:
        methods.append(Method(t, "llama.cpp", "ngram", spec_type=t))
    if s.stock:
        methods += [Method(f"stock-{t}", "llama.cpp", "ngram", spec_type=t, stock=True) for t in s.ngram_types]
    if s.native and CHAINED_NGRAM in s.ngram_types:
        for stock in (False, True) if s.stock else (False,):
            methods += [Method(f"{'stock-' if stock else ''}chain-b{k}", "llama.cpp", "dflash", block_size=k,
                               spec_type=f"{CHAINED_NGRAM},{draft.native_type}", stock=stock, anchor_first=af)
                        for k in native_sizes]
    return methods


def rounds(items: list, i: int, repeat: int) -> Iterator[tuple[int, list]]:
    """(round, items in its order) for prompt i: each round rotated one place further than the last,
    and prompt i's first round i places, so that no method always runs first."""
    for rep in range(repeat):
        shift = (i + rep) % len(items)
        yield rep, items[shift:] + items[:shift]


def fastest_run(runs: list[dict]) -> dict:
    """Of one method's runs on one prompt (`--repeat`), the fastest by decode speed, as timeit takes the
    best of its repeats: another process on a shared machine only ever slows a run down. With more than
    one run the row keeps every run's speed (`repeat_tokens_per_second`, in the order run), and
    `_repeats_differ` where their outputs were not all equal (a deterministic decoder that was not:
    its row is never exact)."""
    best = max(runs, key=lambda r: r.get("tokens_per_second") or 0.0)
    if len(runs) == 1:
        return best
    best = dict(best, repeat_tokens_per_second=[r.get("tokens_per_second") for r in runs])
    outputs = [(r.get("_tokens"), r.get("_text")) for r in runs]
    if any(o != outputs[0] for o in outputs[1:]):
        best["_repeats_differ"] = True
    return best


def runtime_row(m: Method, g) -> dict:
    st = g.stats
    decode_ms = st.t_total_ms - st.t_prefill_ms
    n_dec = st.n_generated - 1  # the first token comes from the prompt's logits
    row = {
        "n_tokens": st.n_generated,
        "decode_tokens": n_dec,
        "decode_ms": decode_ms,
        "tokens_per_second": 1000.0 * n_dec / decode_ms if n_dec > 0 and decode_ms > 0 else None,
        "prefill_ms": st.t_prefill_ms,
        "time_split_ms": {"prefill": st.t_prefill_ms, "draft": st.t_draft_ms, "verify": st.t_verify_ms,
                          "other": st.t_other_ms, "total": st.t_total_ms},
        "stop_reason": g.stop_reason,
    }
    if m.kind == "dflash":
        drafted = sum(len(x.drafted) for x in g.steps)
        accepted = sum(x.accepted for x in g.steps)
        row.update(tau=g.tau, steps=len(g.steps), n_drafted=drafted, n_accepted=accepted,
                   acceptance_rate=accepted / drafted if drafted else None,
                   acceptance_by_position=list(g.acceptance_by_position),
                   acceptance_lengths=[x.produced for x in g.steps],
                   # the draft's own record (an n-gram step of the adaptive loop may verify up to NGRAM_MAX)
                   drafted_per_step=[len(x.drafted) for x in g.steps if x.source != "ngram"],
                   accepted_per_step=[x.accepted for x in g.steps if x.source != "ngram"])
    if getattr(g, "policy", None) is not None:
        row["policy"] = asdict(g.policy)
    return row


def _peer_row(m: Method, r: peers.PeerResult) -> dict:
    row = {
        "n_tokens": r.n_tokens + (1 if m.key == "llama-completion" else 0),
        "decode_tokens": r.n_tokens,
        "decode_ms": r.decode_ms,
        "tokens_per_second": r.tokens_per_second,
        "prefill_ms": r.prompt_ms,
        "time_split_ms": {"prefill": r.prompt_ms, "decode": r.decode_ms},
        "stop_reason": "stop_token" if r.stopped else "max_tokens",
        "tool": r.command[0] if r.command else None,  # which build of the pinned tool ran
    }
    if r.n_drafted is not None:
        row.update(n_drafted=r.n_drafted, n_accepted=r.n_accept,
                   acceptance_rate=r.n_accept / r.n_drafted if r.n_drafted else None)
        if m.kind == "dflash" and m.n_draft:
            # native DFlash drafts exactly n_max tokens every step, so steps = drafted / n_max
            steps = r.n_drafted / m.n_draft
            row.update(steps=steps, tau=(r.n_accept + steps) / steps if steps else None)
    return row


class Bench:
    """Runs the benchmark; `progress(n, what)` is told after every measurement."""

    def __init__(self, s: Settings, progress: Callable[[int, str], None] = lambda n, what: None):
        self.s = s
        self.progress = progress
        self.retotal: Callable[[int], None] = lambda extra: None  # the plan changed by `extra` runs
        from dflash_llama import Runtime

        self.rt = Runtime(s.target, s.draft, n_threads=s.threads, n_ctx=s.n_ctx, n_gpu_layers=s.n_gpu_layers)
        self.block_size = self.rt.block_size
        self.draft_kind = DraftKind.of(self.rt)
        self.tokens = {p.id: self.rt.tokenize(p.text) for p in s.prompts + s.pilot}
        too_long = [(pid, len(t)) for pid, t in self.tokens.items()
                    if len(t) + s.n_predict + max(s.block_sizes + [self.block_size]) > s.n_ctx]
        if too_long:
            raise ValueError(f"prompt {too_long[0][0]} has {too_long[0][1]} tokens: with -n {s.n_predict} it does "
                             f"not fit the context of {s.n_ctx} tokens (raise --ctx-size)")
        self.ref_tokens: dict[str, list[int]] = {}  # our plain decoding's tokens per prompt (main loop)
        self.peer_failure: str | None = None  # a llama.cpp tool that failed and stopped the main loop
        self._stock_exe: Path | None = None
        self._patched = None  # patchbuild.Build of llama-server, once made

    def stock_exe(self) -> Path:
        """llama-speculative-simple from a stock build of the pin, made (or found cached) once."""
        if self._stock_exe is None:
            from dflash_llama import toolbuild

            self._stock_exe = toolbuild.stock_tool("llama-speculative-simple")
        return self._stock_exe

    def patched_server(self):
        """llama-server built from the pinned tree with patches/series (dflash_llama.patchbuild), made once."""
        if self._patched is None:
            from dflash_llama import patchbuild

            self._patched = patchbuild.patched_build(tools=("llama-server",), log=lambda m: None)
        return self._patched

    # -- planning -----------------------------------------------------------------------------
    def count_runs(self) -> dict[str, int]:
        """Measurements per phase, for the progress bar (before the pick is known: assume one more row)."""
        b = self.block_size
        n_methods = len(plan_methods(self.s, b, pick=1 if b > 2 else None, draft=self.draft_kind))
        return {
            "warmup": 2,
            "cost_model": len(self.s.pilot) * (1 + (b - 1)) + len(self.s.pilot),
            "main": n_methods * len(self.s.prompts) * self.s.repeat,
            "server": min(self.s.server_prompts, len(self.s.prompts)) * len(self.s.server_concurrency)
            if self.s.server else 0,
            "threads": self.thread_study(self.s.prompts, {}).count_runs() if self.s.thread_study else 0,
        }

    def thread_study(self, done: list[Prompt], ref_texts: dict[str, tuple[str, bool]]):
        """The thread study on `thread_prompts` of the prompts the main loop finished."""
        from dflash_llama.prompts import spread

        from .thread_study import ThreadStudy

        return ThreadStudy(self.s, spread(done, self.s.thread_prompts), self.tokens, self.ref_tokens, ref_texts,
                           self.s.busy_cores, self.progress)

    def thread_study_estimate_s(self, rows: list[dict]) -> float:
        """Expected length of the thread study: its runs at what our default loop and llama-completion
        cost per prompt in the main loop."""
        if not self.s.thread_study or not rows:
            return 0.0
        per = [((r["prefill_ms"] or 0) + r["decode_ms"]) / 1000.0 for r in rows
               if r["method"] in ("runtime-auto", "llama-completion")]
        return self.thread_study(self.s.prompts, {}).estimate_s(statistics.mean(per) + 0.3) if per else 0.0

    # -- phases -------------------------------------------------------------------------------
    def warmup(self) -> None:
        first = self.tokens[self.s.prompts[0].id]
        self.rt.autoregressive(first, 8, stop_at_eog=False)
        self.progress(1, "warm-up")
        self.rt.generate(first, 8, draft_max=None, stop_at_eog=False)
        self.progress(1, "warm-up")

    def cost_model(self) -> dict:
        """Acceptance curve and step costs on the pilot prompts; the pick of N."""
        b = self.block_size
        pilot = [self.tokens[p.id] for p in self.s.pilot]
        steps = []
        for toks in pilot:  # the acceptance curve at the trained block, full -n
            g = self.rt.generate(toks, self.s.n_predict, block_size=b, draft_max=None)  # the whole block
            steps += g.steps
            self.progress(1, "cost model: acceptance")
        costs, gens = cost_model.calibrate(self.rt, pilot, list(range(1, b)), block_size=b,
                                           max_new_tokens=self.s.calibration_tokens,
                                           on_run=lambda k: self.progress(1, "cost model: step costs"))
        steps += [x for n, g in gens if n == b - 1 for x in g.steps]
        ar_ms = []
        for toks in pilot:
            ar_ms.append(cost_model.autoregressive_step_ms(self.rt, [toks], self.s.calibration_tokens))
            self.progress(1, "cost model: autoregressive step")
        surv = cost_model.survival(steps)
        self.costs = costs
        preds = cost_model.predict(surv, costs)
        pick = cost_model.choose(surv, costs)
        out = cost_model.to_json(costs, preds, pick)
        out.update(block_size=b, survival=surv, pilot_prompts=[p.id for p in self.s.pilot],
                   pilot_steps=len(steps), autoregressive_step_ms=statistics.median(ar_ms),
                   autoregressive_tokens_per_second=1000.0 / statistics.median(ar_ms),
                   calibration_tokens=self.s.calibration_tokens)
        return out

    def run_method(self, m: Method, p: Prompt) -> dict:
        s = self.s
        toks = self.tokens[p.id]
        if m.key == "runtime-ar":
            g = self.rt.autoregressive(toks, s.n_predict)
            row = runtime_row(m, g)
            row["_tokens"], row["_text"] = g.tokens, g.text
        elif m.impl == "dflash-llama":
            g = self.rt.generate(toks, s.n_predict, block_size=m.block_size,
                                 draft_max="auto" if m.adaptive else m.draft_max, ngram=m.ngram,
                                 confidence=m.confidence)
            row = runtime_row(m, g)
            row["_tokens"], row["_text"] = g.tokens, g.text
        elif m.key == "llama-completion":
            r = peers.completion(s.target, p.text, s.n_predict, threads=s.threads, n_ctx=s.n_ctx,
                                 n_gpu_layers=s.n_gpu_layers)
            row = _peer_row(m, r)
            row["_text"], row["_stopped"] = r.text, r.stopped
        else:  # llama-speculative-simple, ours or the stock build
            exe = self.stock_exe() if m.stock else None
            if m.key in ("llama-spec-ar", "stock-spec-ar"):
                r = peers.speculative_plain(s.target, p.text, s.n_predict, threads=s.threads, n_ctx=s.n_ctx,
                                            n_gpu_layers=s.n_gpu_layers, exe=exe)
            else:
                r = peers.speculative(s.target, p.text, s.n_predict, m.spec_type, threads=s.threads, n_ctx=s.n_ctx,
                                      draft=s.draft if m.kind == "dflash" else None,
                                      n_max=m.n_draft if m.kind == "dflash" else None, n_gpu_layers=s.n_gpu_layers,
                                      exe=exe)
            row = _peer_row(m, r)
            row["_text"], row["_stopped"] = r.text, r.stopped
        return row

    def main_loop(self, methods: list[Method], fits: Callable[[list[dict], float], bool] = lambda rows, t: True
                  ) -> list[dict]:
        """Every method on every prompt, interleaved; stops early when `fits(rows, seconds per prompt)`
        says the next prompt would not fit the time budget, or when a llama.cpp tool fails (`peer_failure`
        says which, on what; the prompts before it are kept, the one it failed on is dropped, and the
        failure is raised when there is none before it)."""
        rows = []
        t0 = time.monotonic()
        for i, p in enumerate(self.s.prompts):
            if i and not fits(rows, (time.monotonic() - t0) / i):
                break
            runs: dict[str, list[dict]] = {m.key: [] for m in methods}
            for rep, order in rounds(methods, i, self.s.repeat):
                for m in order:
                    try:
                        runs[m.key].append(self.run_method(m, p))
                    except peers.PeerError as e:
                        if not rows:
                            raise
                        message = " ".join(str(e).split())  # one line with its log tail, as the CLI prints errors
                        self.peer_failure = f"{m.label} failed on {p.id}: {message}"
                        return rows
                    self.progress(1, f"{p.id} {m.key}" + (f" ({rep + 1}/{self.s.repeat})" if self.s.repeat > 1 else ""))
            results = {key: fastest_run(r) for key, r in runs.items()}
            self._equal_lengths(p, methods, results)
            self.ref_tokens[p.id] = results["runtime-ar"]["_tokens"]
            rows += self._compare(p, methods, results)
        return rows

    def _equal_lengths(self, p: Prompt, methods: list[Method], results: dict[str, dict]) -> None:
        """llama-speculative-simple stops only once it has passed -n, and at its last step, asked for a
        draft of 0 tokens, the pin drafts without limit (a budget of 0 reads as none: ngram-mod drafts up
        to 64 tokens past -n), so its speed counts tokens ours never decodes, the last ones its cheapest.
        Where a llama.cpp row decoded more than one token past -n, our default loop decodes the prompt
        again to that length (once per length), for the comparison of the two at equal length."""
        default = next((m for m in methods if m.key == "runtime-auto"), None)
        if default is None:
            return
        done: dict[int, tuple] = {}
        for m in methods:
            r = results[m.key]
            n = r.get("n_tokens") or 0
            if m.impl != "llama.cpp" or n <= self.s.n_predict + 1:
                continue
            if n not in done:
                self.retotal(self.s.repeat)
                again = []
                for _ in range(self.s.repeat):
                    g = self.rt.generate(self.tokens[p.id], n, block_size=default.block_size, draft_max="auto")
                    again.append(runtime_row(default, g) | {"_tokens": g.tokens})
                    self.progress(1, f"{p.id} runtime-auto at {n} tokens")
                best = fastest_run(again)
                tokens = best.pop("_tokens") if not best.pop("_repeats_differ", False) else []
                done[n] = (tokens, best)
            r["_equal_length"] = done[n]

    @staticmethod
    def _compare(p: Prompt, methods: list[Method], results: dict[str, dict]) -> list[dict]:
        """Rows of one prompt with their exactness: our speculative rows against our plain decoding
        (tokens); llama.cpp's speculative rows against the same tool without drafts (text); the plain
        decoders against each other. Every row also says whether its text is llama-completion's."""
        ar, lc, sar = results["runtime-ar"], results["llama-completion"], results.get("llama-spec-ar")
        stock_sar = results.get("stock-spec-ar")
        out = []
        for m in methods:
            r = results[m.key]
            if m.impl == "dflash-llama" and m.kind == "dflash":
                exact, diff = r["_tokens"] == ar["_tokens"], first_mismatch(r["_tokens"], ar["_tokens"])
                against, unit = "runtime-ar", "token"
            elif m.key == "runtime-ar":
                exact, diff = text_matches(r["_text"], lc["_text"], True)
                against, unit = "llama-completion", "char"
            elif m.key == "llama-completion":
                exact, diff = text_matches(r["_text"], ar["_text"], True)
                against, unit = "runtime-ar", "char"
            elif m.key in ("llama-spec-ar", "stock-spec-ar"):
                exact, diff = text_matches(r["_text"], lc["_text"], lc["_stopped"])
                against, unit = "llama-completion", "char"
            elif m.stock:
                exact, diff = text_matches(r["_text"], stock_sar["_text"], stock_sar["_stopped"])
                against, unit = "stock-spec-ar", "char"
            else:
                exact, diff = text_matches(r["_text"], sar["_text"], sar["_stopped"])
                against, unit = "llama-spec-ar", "char"
            if r.get("_repeats_differ"):  # a deterministic decoder whose repeated runs did not agree
                exact = False
            same_as_lc = text_matches(r["_text"], lc["_text"], lc["_stopped"] or m.impl == "dflash-llama")[0]
            row = {"prompt": p.id, "method": m.key, "label": m.label, "impl": m.impl, "kind": m.kind,
                   "block_size": m.block_size, "n_draft": m.n_draft, "spec_type": m.spec_type, "auto": m.auto,
                   "adaptive": m.adaptive,
                   "exact": bool(exact), "exact_against": against, "first_difference": diff,
                   "first_difference_unit": unit if diff is not None else None,
                   "same_text_as_llama_completion": bool(same_as_lc)}
            if r.get("_repeats_differ"):
                row["repeats_differ"] = True
            row.update({k: v for k, v in r.items() if not k.startswith("_")})
            if "_equal_length" in r:  # our default loop at this row's length: its speed, and its exactness
                tokens, ours = r["_equal_length"]
                row["default_loop_at_this_length"] = {
                    k: ours[k] for k in ("n_tokens", "decode_tokens", "decode_ms", "tokens_per_second")}
                row["default_loop_at_this_length"]["exact"] = tokens[:len(ar["_tokens"])] == ar["_tokens"]
            out.append(row)
        # the references' texts, for readers who want to look (and the server's exactness)
        out.append({"prompt": p.id, "method": "_texts", "runtime_ar_text": ar["_text"],
                    "llama_completion_text": lc["_text"], "llama_completion_stopped": lc["_stopped"],
                    "llama_spec_ar_text": sar["_text"] if sar else None})
        return out

    def server_phase(self, n_max: int, reference_texts: dict[str, tuple[str, bool]]) -> dict:
        from . import server

        s = self.s
        done = [p for p in s.prompts if p.id in reference_texts]
        from dflash_llama.prompts import spread

        prompts = [(p.id, p.text) for p in spread(done, s.server_prompts)]
        levels = []
        exe = self.patched_server().tool("llama-server") if s.patched_server else None
        with server.LlamaServer(s.target, s.draft, threads=s.threads, n_ctx=s.n_ctx,
                                n_parallel=max(s.server_concurrency), n_max=n_max,
                                n_gpu_layers=s.n_gpu_layers, exe=exe) as srv:
            command = srv.cmd
            for c in s.server_concurrency:
                res = server.load_test(srv.url, prompts, s.n_predict, c,
                                       on_done=lambda c=c: self.progress(1, f"server, concurrency {c}"))
                summary = res.summary()
                reqs = []
                for r in res.requests:
                    ref, stopped = reference_texts[r.prompt_id]
                    exact, diff = text_matches(r.text, ref, stopped)
                    reqs.append(dict(asdict(r), exact=exact, first_difference=diff))
                summary["exact"] = sum(x["exact"] for x in reqs)
                summary["requests_detail"] = reqs
                levels.append(summary)
            pid = srv.pid
        patches = list(self.patched_server().patches) if s.patched_server else []
        return {"command": command, "build": "patched" if patches else "pinned", "patches": patches,
                "n_max": n_max, "pid": pid,
                "prompts": [p[0] for p in prompts], "levels": levels}

    # -- everything -----------------------------------------------------------------------------
    def server_n_max(self, rows: list[dict], methods: list[Method]) -> int:
        """The server runs native DFlash at its fastest n_max of this run (else the cost model's pick)."""
        native = [m for m in methods if m.impl == "llama.cpp" and m.kind == "dflash" and not m.stock and not m.chain]
        if not native:
            return self.pick
        speeds = {m.n_draft: _speed([r for r in rows if r["method"] == m.key]) for m in native}
        return max(speeds, key=lambda n: (speeds[n] or 0.0, -n))

    def server_estimate_s(self, rows: list[dict], methods: list[Method]) -> float:
        """Expected length of the serving phase: each request costs about what the same setting cost
        llama-speculative-simple (concurrency does not add compute on a CPU)."""
        if not self.s.server or not rows:
            return 0.0
        n_max = self.server_n_max(rows, methods)
        key = next((m.key for m in methods if m.impl == "llama.cpp" and m.kind == "dflash" and not m.stock
                    and not m.chain and m.n_draft == n_max),
                   "llama-completion")
        per = [(r["prefill_ms"] or 0) + r["decode_ms"] for r in rows if r["method"] == key]
        n_prompts = len({r["prompt"] for r in rows if r["method"] == key})
        per_request_s = statistics.mean(per) / 1000.0 + 0.05
        return 5.0 + per_request_s * min(self.s.server_prompts, n_prompts) * len(self.s.server_concurrency)

    # -- everything -----------------------------------------------------------------------------
    def run(self) -> dict:
        s = self.s
        t0 = time.time()
        load_start = _loadavg()
        if self.s.stock:
            self.stock_exe()  # a failing build fails before anything is measured
        if self.s.server and self.s.patched_server:
            self.patched_server()
        self.warmup()
        cm = self.cost_model()
        pick = cm["pick"]["n_draft"] if s.draft_max == "auto" else int(s.draft_max)
        if pick > self.block_size - 1:
            raise ValueError(f"--draft-max {pick} exceeds the draft's block: "
                             f"at most {self.block_size - 1} drafted tokens")
        self.pick = cm["used_n_draft"] = pick
        methods = plan_methods(s, self.block_size, pick, self.draft_kind)
        assumed = len(plan_methods(s, self.block_size, 1 if self.block_size > 2 else None, self.draft_kind))
        self.retotal((len(methods) - assumed) * len(s.prompts) * s.repeat)

        def fits(rows: list[dict], per_prompt_s: float) -> bool:
            if s.deadline is None:
                return True
            finish = (time.monotonic() + per_prompt_s + self.server_estimate_s(rows, methods)
                      + self.thread_study_estimate_s(rows) + REPORT_S)
            return finish <= s.deadline

        rows = self.main_loop(methods, fits)
        texts = {r["prompt"]: (r["llama_completion_text"], r["llama_completion_stopped"])
                 for r in rows if r["method"] == "_texts"}
        n_done = len(texts)
        if n_done < len(s.prompts):  # the progress bar planned for every prompt
            self.retotal(-(len(s.prompts) - n_done) * len(methods) * s.repeat)
            if s.server:
                self.retotal(len(s.server_concurrency) *
                             (min(s.server_prompts, n_done) - min(s.server_prompts, len(s.prompts))))
        if self.peer_failure:  # neither the serving phase nor the thread study will run
            self.retotal(-(len(s.server_concurrency) * min(s.server_prompts, n_done) if s.server else 0)
                         - (self.thread_study(s.prompts, {}).count_runs() if s.thread_study else 0))
        # after a tool's failure the report is written with what was measured, nothing more is run
        srv = self.server_phase(self.server_n_max(rows, methods), texts) if s.server and not self.peer_failure else None
        done = [p for p in s.prompts if p.id in texts]
        if s.thread_study and not self.peer_failure:
            study = self.thread_study(done, texts)
            self.retotal(study.count_runs() - self.thread_study(s.prompts, {}).count_runs())
            threads = study.run()
        else:
            threads = None
        summary = summarise(rows, methods)
        # the model's predictions against this run's measurements; "bench acceptance" re-predicts with the
        # acceptance measured on the benchmark prompts, separating timing error from acceptance sampling
        full = summary.get(f"runtime-b{self.block_size}")
        bench_preds = (cost_model.predict(full["acceptance_by_position"], self.costs)
                       if full and full.get("acceptance_by_position") else None)
        if bench_preds:
            cm["predictions_bench_acceptance"] = [asdict(p) for p in bench_preds]
        cm["loop_step_costs"] = self.rt.step_costs(self.block_size)  # the adaptive loop's own, once per run
        cm["checks"] = []
        for m in methods:
            if m.impl == "dflash-llama" and m.kind == "dflash" and m.block_size == self.block_size:
                pilot = next((p["tokens_per_second"] for p in cm["predictions"] if p["n_draft"] == m.n_draft), None)
                post = next((p.tokens_per_second for p in bench_preds or [] if p.n_draft == m.n_draft), None)
                cm["checks"].append({"method": m.key, "n_draft": m.n_draft,
                                     "measured_tokens_per_second": summary[m.key]["tokens_per_second"],
                                     "predicted_tokens_per_second": pilot,
                                     "predicted_with_bench_acceptance": post})
                if m.n_draft == pick:
                    cm.update(measured_key=m.key, measured_tokens_per_second=summary[m.key]["tokens_per_second"],
                              predicted_tokens_per_second=pilot, predicted_with_bench_acceptance=post)
        return {
            "schema": SCHEMA,
            "meta": machine_info() | {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
                                      "wall_s": time.time() - t0, "loadavg_start": load_start,
                                      "loadavg_end": _loadavg()},
            "settings": {"target": s.target, "draft": s.draft, "n_predict": s.n_predict, "block_sizes": s.block_sizes,
                         "prompts_planned": len(s.prompts),
                         "stopped_by_budget": n_done < len(s.prompts) and not self.peer_failure,
                         "stopped_by_failure": self.peer_failure, "server_prompts": s.server_prompts,
                         "draft_block_size": self.block_size, "draft_max": s.draft_max, "threads": s.threads,
                         "n_ctx": s.n_ctx, "repeat": s.repeat, "ngram_types": s.ngram_types, "native": s.native,
                         "stock_build": s.stock, "patched_server": s.patched_server,
                         "server": s.server, "server_concurrency": s.server_concurrency,
                         "prompts": [{"id": p.id, "n_tokens": len(self.tokens[p.id])} for p in s.prompts
                                     if p.id in texts],
                         "pilot_prompts": [p.id for p in s.pilot]},
            "methods": [dict(asdict(m), label=m.label, n_draft=m.n_draft, chain=m.chain) for m in methods],
            "summary": summary,
            "ratios": ratios(rows, methods, self.block_size),
            "cost_model": cm,
            "server": srv,
            "threads": threads,
            "rows": [r for r in rows if r["method"] != "_texts"],
            "texts": [r for r in rows if r["method"] == "_texts"],
        }


def summarise(rows: list[dict], methods: list[Method]) -> dict:
    """Per method: speed over all tokens, paired speedups, acceptance pooled over prompts, exactness."""
    by = {m.key: [r for r in rows if r["method"] == m.key] for m in methods}
    base = {k: {r["prompt"]: r for r in by[k]} for k in ("runtime-ar", "llama-completion")}
    out = {}
    for m in methods:
        rs = by[m.key]
        dec_tokens = sum(r["decode_tokens"] for r in rs)
        dec_ms = sum(r["decode_ms"] for r in rs)
        tps = 1000.0 * dec_tokens / dec_ms if dec_ms > 0 else None
        item = {"label": m.label, "impl": m.impl, "kind": m.kind, "block_size": m.block_size, "n_draft": m.n_draft,
                "auto": m.auto, "prompts": len(rs), "exact": sum(r["exact"] for r in rs),
                "all_exact": all(r["exact"] for r in rs), "decode_tokens": dec_tokens, "decode_ms": dec_ms,
                "same_text_as_llama_completion": sum(r["same_text_as_llama_completion"] for r in rs),
                "tokens_per_second": tps}
        for k in ("runtime-ar", "llama-completion"):
            per = [r["tokens_per_second"] / base[k][r["prompt"]]["tokens_per_second"] for r in rs
                   if r["tokens_per_second"] and base[k][r["prompt"]]["tokens_per_second"]]
            b = by[k]
            b_tps = 1000.0 * sum(r["decode_tokens"] for r in b) / sum(r["decode_ms"] for r in b)
            item[f"speedup_vs_{k}"] = tps / b_tps if tps and b_tps else None
            item[f"median_prompt_speedup_vs_{k}"] = statistics.median(per) if per else None
        if any("steps" in r for r in rs):
            steps = sum(r.get("steps", 0) for r in rs)
            drafted = sum(r.get("n_drafted", 0) for r in rs)
            accepted = sum(r.get("n_accepted", 0) for r in rs)
            item["acceptance_rate"] = accepted / drafted if drafted else None
            item["tau"] = (accepted + steps) / steps if steps else None
        elif any("n_drafted" in r for r in rs):
            drafted = sum(r.get("n_drafted", 0) for r in rs)
            accepted = sum(r.get("n_accepted", 0) for r in rs)
            item["acceptance_rate"] = accepted / drafted if drafted else None
            item["drafted_tokens"] = drafted
        if m.impl == "dflash-llama" and m.kind == "dflash":
            lengths = [x for r in rs for x in r["acceptance_lengths"]]
            item["tau"] = sum(lengths) / len(lengths) if lengths else None
            item["acceptance_length_histogram"] = {str(k): lengths.count(k)
                                                   for k in range(1, max([m.block_size, *lengths]) + 1)}
            item["acceptance_by_position"] = cost_model.survival(
                [pair for r in rs for pair in zip(r["drafted_per_step"], r["accepted_per_step"])])
            split = {k: sum(r["time_split_ms"][k] for r in rs)
                     for k in ("prefill", "draft", "verify", "other", "total")}
            item["time_split_ms"] = split
        if m.adaptive:
            item["policy"] = _pooled_policy([r["policy"] for r in rs if "policy" in r])
        out[m.key] = item
    return out


def _pooled_policy(policies: list[dict]) -> dict | None:
    """The adaptive loop's choices over all prompts: plain share and mean N pooled over steps."""
    if not policies:
        return None
    plain = sum(p["plain_steps"] for p in policies)
    drafting = sum(p["draft_steps"] for p in policies)
    ngram = sum(p["ngram_steps"] for p in policies)
    drafted = sum(p["mean_draft"] * p["draft_steps"] for p in policies)
    ngram_drafted = sum(p["ngram_drafted"] for p in policies)
    return {"plain_steps": plain, "draft_steps": drafting, "ngram_steps": ngram,
            "ngram_drafted": ngram_drafted, "ngram_accepted": sum(p["ngram_accepted"] for p in policies),
            "probes": sum(p["probes"] for p in policies),
            "plain_share": plain / (plain + drafting + ngram) if plain + drafting + ngram else None,
            "mean_draft": drafted / drafting if drafting else None,
            "median_predicted_tokens_per_second": statistics.median(p["predicted_tokens_per_second"] for p in policies),
            **{k: sum(p.get(k, 0) for p in policies) for k in CONFIDENCE_FIELDS}}


# the confidence gate's counts in a Policy, summed over prompts
CONFIDENCE_FIELDS = ("confidence_steps", "confidence_cut", "confidence_expected", "position_expected",
                     "confidence_accepted")


def ratios(rows: list[dict], methods: list[Method], block_size: int) -> list[dict]:
    """The ratios the report promises, from rows of this run: over all tokens and the median of per-prompt ratios."""
    keys = {m.key for m in methods}

    def pair(a: str, b: str, what: str, equal_length: bool = False) -> dict | None:
        """equal_length: where a row of b decoded past -n, a's speed at b's length (our default loop)."""
        if a not in keys or b not in keys:
            return None
        rb = {r["prompt"]: r for r in rows if r["method"] == b}
        ra = {r["prompt"]: r for r in rows if r["method"] == a}
        if equal_length:
            longer = {p: r["default_loop_at_this_length"] for p, r in rb.items() if "default_loop_at_this_length" in r}
            if not longer:
                return None  # no row of b went past -n: the plain ratio says it all
            ra.update((p, r) for p, r in longer.items() if p in ra)
            inexact = sum(not r["exact"] for r in longer.values())
            what += f" ({len(longer)} of {len(rb)} prompts past -n{f'; {inexact} NOT EXACT' if inexact else ''})"
        tot = lambda rs: 1000.0 * sum(r["decode_tokens"] for r in rs) / sum(r["decode_ms"] for r in rs)  # noqa: E731
        per = [ra[p]["tokens_per_second"] / rb[p]["tokens_per_second"] for p in ra
               if ra[p]["tokens_per_second"] and rb[p]["tokens_per_second"]]
        return {"what": what, "numerator": a, "denominator": b, "ratio": tot(ra.values()) / tot(rb.values()),
                "median_prompt_ratio": statistics.median(per) if per else None}

    out = []
    for m in methods:
        if m.kind != "dflash" or m.impl != "dflash-llama":
            continue
        if m.adaptive:
            out.append(pair(m.key, f"native-b{m.block_size}", f"{m.label} / native DFlash, B={m.block_size}"))
            out.append(pair(m.key, f"stock-b{m.block_size}",
                            f"{m.label} / native DFlash (stock build), B={m.block_size}"))
        elif m.draft_max is None:
            out.append(pair(m.key, f"native-b{m.block_size}", f"our runtime / native DFlash, B={m.block_size}"))
            out.append(pair(m.key, f"stock-b{m.block_size}",
                            f"our runtime / native DFlash (stock build), B={m.block_size}"))
        out.append(pair(m.key, "runtime-ar", f"{m.label} / our autoregressive"))
        out.append(pair(m.key, "llama-completion", f"{m.label} / llama-completion"))
    for m in methods:
        if m.impl == "llama.cpp" and m.kind == "dflash":
            out.append(pair(m.key, "llama-completion", f"{m.label} / llama-completion"))
            out.append(pair(m.key, "stock-spec-ar" if m.stock else "llama-spec-ar",
                            f"{m.label} / the same tool without drafts"))
            if m.stock:
                ours = f"{'chain' if m.chain else 'native'}-b{m.block_size}"
                out.append(pair(m.key, ours, f"{m.label} / the same, built like ours"))
    for stock in (False, True):
        best = fastest(rows, [m for m in methods if m.impl == "llama.cpp" and m.stock == stock])
        if best is not None:
            mode = f"our default loop / the fastest llama.cpp mode{' of the stock build' if stock else ''} " \
                   f"({best.label}{_inexact_note(rows, best.key)})"
            out.append(pair("runtime-auto", best.key, mode))
            out.append(pair("runtime-auto", best.key, f"{mode}, at equal length", equal_length=True))
    out.append(pair("runtime-auto", "runtime-auto-no-confidence",
                    "our default loop / the same without its confidence gate"))
    out.append(pair("stock-spec-ar", "llama-spec-ar", "stock build / built like ours, no drafts"))
    out.append(pair("runtime-ar", "llama-completion", "our autoregressive / llama-completion"))
    return [r for r in out if r is not None]


def _inexact_note(rows: list[dict], key: str) -> str:
    """For a ratio's label: how many of a method's rows were not exact (its text not its reference's);
    the fastest mode is chosen by speed alone, and a fast mode that is not exact is named as such."""
    rs = [r for r in rows if r["method"] == key]
    inexact = sum(r.get("exact") is False for r in rs)
    return f"; NOT EXACT on {inexact} of {len(rs)} prompts" if inexact else ""


def fastest(rows: list[dict], methods: list[Method]) -> Method | None:
    """The method of the highest speed over all its tokens in `rows` (None: no rows of them)."""
    speeds = {}
    for m in methods:
        rs = [r for r in rows if r["method"] == m.key]
        ms = sum(r["decode_ms"] for r in rs)
        if ms > 0:
            speeds[m] = sum(r["decode_tokens"] for r in rs) / ms
    return max(speeds, key=speeds.get) if speeds else None


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


# The vector extensions that pick ggml's CPU kernels (and so a run's speed ratios), in /proc/cpuinfo's
# spelling: the same model name can come with AVX-512 or without it.
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_int8", "neon", "asimddp", "sve")


def simd_features(flags: str) -> list[str]:
    """The extensions of SIMD_FLAGS among a cpuinfo `flags` (or ARM `Features`) line's words, in that order."""
    have = set(flags.split())
    return [f for f in SIMD_FLAGS if f in have]


def machine_info() -> dict:
    import os

    import dflash_llama

    cpu, simd = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and simd is None:
                simd = simd_features(value)
    except OSError:
        pass
    return {"cpu": cpu or platform.processor(), "simd": simd, "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": platform.platform(), "python": platform.python_version(),
            "dflash_llama": dflash_llama.__version__, "llama_cpp": dflash_llama.llama_cpp_commit()}
