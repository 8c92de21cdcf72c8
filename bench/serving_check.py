"""Serving check: llama-server's DFlash acceptance with 1 and with 8 requests in flight, on a tiny
qwen35 hybrid (recurrent) target whose draft is often accepted.

    python -m dflash_llama.bench.serving_check [--out DIR] [--variants dflash,dflash2] [-n 48]
                                               [--n-max 3,7] [-t 1] [--repeats 3]

A hybrid target makes llama.cpp split a multi-sequence batch by sequence (`split_equal`), so the
rows of a batch are computed out of order and put back (`llama_context::output_reorder`): if the
captured layer inputs the DFlash draft reads were not put back, a sequence's draft would read
another sequence's rows once several requests share a batch (llama.cpp #29019). The check serves
the same prompts greedily with `-np 1` (one request at a time) and `-np 8` (eight at once), at each
`--spec-draft-n-max`, and compares the acceptance (the server's `draft_n`, `draft_n_accepted`) and
the texts, with the plain target's greedy texts (no draft) as the reference.

The pair (`build_pair`, deterministic: fixed seeds throughout):
- the target: the tiny qwen35 fixture target (families.py) with its sublayer outputs scaled down
  (`BRANCH_SCALE`) and a cyclic bigram added to its head (`cyclic_head`): the residual stream is
  then mostly the current token's embedding, the head prefers the next token of a 4-token cycle,
  and the context still decides where a cycle is entered, so the greedy text is a few jumps
  followed by a repeating cycle. A random tiny target writes text that never repeats, which no draft
  learns in minutes (held-out tau 1.00 after 300 steps);
- a DFlash 1 draft trained on it by `dflash-llama train` (its greedy answers to standard-library
  prompts), and a DFlash 2 draft trained from it (`--variant dflash2 --init`), both converted by
  `dflash-llama convert`.

    python -m dflash_llama.bench.serving_check --rollback-check [RUNS] [--out DIR]

checks finding U11 instead (docs/upstream_status.md): the tiny qwen35 fixture target with a random
draft, whose every verify rolls the target back, at -np 1 and -np 8, RUNS times each; exit status 1
when some text at -np 8 is not the plain target's and none at -np 1 is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash_llama import fixtures
from dflash_llama.argtypes import int_list

from . import server

PERIOD = 4  # the head's cycle: token y -> PERIOD * (y // PERIOD) + (y + 1) % PERIOD
BRANCH_SCALE = 0.015  # sublayer outputs (attention, linear attention, MLP) scaled by this
HEAD_GAIN = 1.0  # weight of the cyclic bigram added to the random head
TARGET_LAYER_IDS = "1,2"
# the draft's training (a few minutes at one thread)
TRAIN_ARGS = ("--prompts", "192", "--max-new-tokens", "64", "--layers", "2", "--block-size", "8",
              "--target-layer-ids", TARGET_LAYER_IDS, "--lr", "2e-3", "--eval-every", "100", "--seed", "0")
DFLASH1_EPOCHS = "25"
DFLASH2_EPOCHS = "10"
DFLASH2_ARGS = ("--conv-kernel-size", "2", "--conv-group-size", "16", "--selector-rank", "16",
                "--selector-top-k", "4")

# served prompts, alternating: a function whose docstring is closed (the target then enters the
# cycle its draft learned: most of the training prompts end there) and a varied text (another
# cycle, rarely accepted). Eight requests in flight then share batches with sequences of other
# cycles, so a draft handed another request's rows would lose most of its acceptance (`row_check`).
PROMPTS = [
    'def isabs(path):\n    """Test whether a path is absolute"""\n', "The capital of France is",
    'def getsize(filename):\n    """Return the size of a file, reported by os.stat()."""\n', "x = [1, 2, 3]\n",
    'def encode(input, output):\n    """Encode a file; input and output are binary files."""\n',
    "for i in range(10):",
    'def compile(pattern, flags=0):\n    "Compile a regular expression pattern, returning a Pattern object."\n',
    "Once upon a time",
    'def choice(self, seq):\n    """Choose a random element from a non-empty sequence."""\n',
    "SELECT name FROM users WHERE",
    'def basename(p):\n    """Returns the final component of a pathname"""\n', "The quick brown fox",
    'def exists(path):\n    """Test whether a path exists."""\n', "def parse(text: str) -> dict:",
    'def upper(s):\n    """Return a copy of s converted to uppercase."""\n', "Dear committee members,",
]
PARALLEL = (1, 8)


def cyclic_head(hf_dir: str | Path, period: int = PERIOD, branch_scale: float = BRANCH_SCALE,
                head_gain: float = HEAD_GAIN) -> None:
    """Rewrite the tiny target's weights in `hf_dir` (model.safetensors) in place: sublayer output
    projections times `branch_scale`, and to the head row of token y, `head_gain` times the
    embedding of its cycle predecessor (so a hidden state near token x's embedding scores x's cycle
    successor highest)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(hf_dir) / "model.safetensors"
    state = load_file(str(path))
    for name in state:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            state[name] = state[name] * branch_scale
    head, embed = state["lm_head.weight"], state["model.embed_tokens.weight"]
    y = torch.arange(head.shape[0])
    whole = y < head.shape[0] // period * period  # a last, incomplete group keeps its random rows
    pred = torch.where(whole, period * (y // period) + (y - 1) % period, y)
    state["lm_head.weight"] = (head + head_gain * whole[:, None] * embed[pred]).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})


def cyclic_target(out_dir: str | Path) -> Path:
    """The serving check's target GGUF (f32), built in `out_dir` (reused when there)."""
    out = Path(out_dir)
    gguf = out / "target.gguf"
    if not gguf.exists():
        hf = fixtures.tiny_target_hf(out / "target_hf", fixtures.TinyTargetConfig(family="qwen35"))
        cyclic_head(hf)
        fixtures.tiny_target_gguf(hf, gguf, family="qwen35")
    return gguf


def _dflash_llama(*args: str) -> None:
    """Run a `dflash-llama` subcommand; RuntimeError with its last words if it fails."""
    r = subprocess.run([sys.executable, "-m", "dflash_llama.cli", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dflash-llama {args[0]} exited with {r.returncode}:\n{r.stderr.strip()[-2000:]}")


def trained_draft(target: Path, out_dir: Path, variant: str, init: Path | None = None, threads: int = 1) -> Path:
    """A draft trained on `target` into out_dir/<variant> (the dataset in out_dir/data, shared by
    both variants) and its GGUF (out_dir/<variant>.gguf); reused when there. DFlash 2 starts from
    the DFlash 1 checkpoint `init`."""
    hf, gguf = out_dir / variant, out_dir / f"{variant}.gguf"
    if gguf.exists():
        return gguf
    if variant == "dflash2":
        how = ("--variant", "dflash2", *DFLASH2_ARGS, "--init", str(init), "--epochs", DFLASH2_EPOCHS)
    else:
        how = ("--epochs", DFLASH1_EPOCHS)
    _dflash_llama("train", "--target", str(target), "--out", str(hf), "--data", str(out_dir / "data"), *TRAIN_ARGS,
                  *how, "-t", str(threads))
    _dflash_llama("convert", "-m", str(target), "-o", str(gguf), "--outtype", "f32", str(hf))
    return gguf


def build_pair(out_dir: str | Path, variants: Sequence[str] = ("dflash", "dflash2"), threads: int = 1
               ) -> tuple[Path, dict[str, Path]]:
    """The target and its trained drafts (by variant) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = cyclic_target(out)
    drafts: dict[str, Path] = {}
    if "dflash" in variants or "dflash2" in variants:
        drafts["dflash"] = trained_draft(target, out, "dflash", threads=threads)
    if "dflash2" in variants:
        drafts["dflash2"] = trained_draft(target, out, "dflash2", init=out / "dflash", threads=threads)
    return target, {v: drafts[v] for v in variants}


@dataclass
class Row:
    """One server run: a draft (None: the plain target) at one --spec-draft-n-max and -np."""
    variant: str
    n_max: int | None
    parallel: int
    texts: list[str]  # per request, in prompt order
    drafted: list[int]  # the server's draft_n per request
    accepted: list[int]  # its draft_n_accepted per request

    @property
    def draft_n(self) -> int:
        return sum(self.drafted)

    @property
    def draft_n_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance(self) -> float | None:
        return self.draft_n_accepted / self.draft_n if self.draft_n else None


def serve(target: Path, draft: Path | None, prompts: Sequence[str], *, n_predict: int, n_max: int | None,
          parallel: int, threads: int, n_ctx: int = 256, variant: str = "plain") -> Row:
    """Every prompt once through llama-server started with `-np parallel`, `parallel` requests in
    flight; the texts in prompt order and the summed draft counts."""
    with server.LlamaServer(target, draft, threads=threads, n_ctx=n_ctx, n_parallel=parallel, n_max=n_max) as srv:
        res = server.load_test(srv.url, [(str(i), p) for i, p in enumerate(prompts)], n_predict, parallel)
    return Row(variant, n_max, parallel, [r.text for r in res.requests], [r.draft_n or 0 for r in res.requests],
               [r.draft_n_accepted or 0 for r in res.requests])


def measure(target: Path, drafts: dict[str, Path], prompts: Sequence[str] = PROMPTS, *, n_predict: int = 48,
            n_maxes: Sequence[int] = (3, 7), parallels: Sequence[int] = PARALLEL, threads: int = 1,
            repeats: int = 1) -> list[Row]:
    """The plain target's rows, then each draft's at every (n_max, parallel); the runs with several
    requests in flight `repeats` times each (how requests meet in batches depends on timing)."""
    def runs(p: int) -> int:
        return repeats if p > 1 else 1

    rows = [serve(target, None, prompts, n_predict=n_predict, n_max=None, parallel=p, threads=threads)
            for p in parallels for _ in range(runs(p))]
    for variant, draft in drafts.items():
        for n_max in n_maxes:
            rows += [serve(target, draft, prompts, n_predict=n_predict, n_max=n_max, parallel=p, threads=threads,
                           variant=variant) for p in parallels for _ in range(runs(p))]
    return rows


def table(rows: Sequence[Row]) -> str:
    """A markdown table: acceptance, how many texts equal the plain target's greedy text at the
    lowest -np, and how many requests drafted and accepted exactly what they did there."""
    lowest = min(x.parallel for x in rows)
    ref = next(r.texts for r in rows if r.variant == "plain" and r.parallel == lowest)
    lines = ["| draft | --spec-draft-n-max | -np | draft_n | draft_n_accepted | acceptance | texts = plain target "
             f"| requests with the counts of -np {lowest} |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = sum(a == b for a, b in zip(r.texts, ref))
        base = next(b for b in rows if (b.variant, b.n_max, b.parallel) == (r.variant, r.n_max, lowest))
        counts = sum(x == y for x, y in zip(zip(r.drafted, r.accepted), zip(base.drafted, base.accepted)))
        acc = f"{r.acceptance:.3f}" if r.acceptance is not None else "-"
        lines.append(f"| {r.variant} | {r.n_max if r.n_max is not None else '-'} | {r.parallel} | {r.draft_n} | "
                     f"{r.draft_n_accepted} | {acc} | {same}/{len(ref)} | {counts}/{len(ref)} |")
    return "\n".join(lines)


def _accepted(rt, seq: Sequence[int], feats, at: int) -> int:
    """How many tokens of `seq` after position `at` the draft gets right in a row, drafting one block
    from the anchor seq[at] with `feats` as the context rows of positions 0..at-1."""
    block = rt.block_size
    trace = rt.trace_draft(feats[:at], [seq[at]] + [0] * (block - 1))
    drafted = trace["selector_path"] if "selector_path" in trace else trace["result_output"][1:].argmax(-1)
    n = 0
    while n < len(drafted) and at + 1 + n < len(seq) and int(drafted[n]) == seq[at + 1 + n]:
        n += 1
    return n


def row_check(target: Path, draft: Path, prompts: Sequence[str] = PROMPTS, *, n_predict: int = 48,
              threads: int = 1, stride: int = 3) -> dict[str, float]:
    """Does the draft need its own request's rows? Through our runtime, for each even-indexed prompt
    (its neighbour in PROMPTS is the next one): the mean number of drafted tokens accepted in a row
    at every `stride`-th anchor of its greedy answer, drafting with its own target rows and with the
    neighbour's rows in their place (the mix-up llama.cpp #29019 describes)."""
    from dflash_llama.runtime import Runtime

    rt = Runtime(target, draft, n_threads=threads, n_ctx=512)
    seqs = []
    for p in prompts:
        ids = rt.tokenize(p)
        seqs.append(ids + list(rt.autoregressive(ids, n_predict).tokens))
    own, other = [], []
    for i in range(0, len(seqs) - 1, 2):
        seq, feats, theirs = seqs[i], rt.capture(seqs[i]), rt.capture(seqs[i + 1])
        start = len(rt.tokenize(prompts[i]))
        for at in range(start, min(len(seq), len(theirs)) - 1, stride):
            own.append(_accepted(rt, seq, feats, at))
            other.append(_accepted(rt, seq, theirs, at))
    return {"anchors": len(own), "own_rows": sum(own) / len(own), "neighbour_rows": sum(other) / len(other)}


# --- the rollback check (finding U11): exactness of the hybrid target's text when every verify
# rolls back; the fixture target and a random draft (parity/registry.toml's tiny-qwen35-f32 pair)
ROLLBACK_DRAFT = dict(layers=2, target_layer_ids=[1, 2], block_size=8, seed=35)


def fixture_pair(out_dir: str | Path, family: str = "qwen35") -> tuple[Path, Path]:
    """The tiny `family` fixture target and a random DFlash draft for it (GGUF f32 both), in out_dir."""
    from dflash_llama.converter import convert

    out = Path(out_dir)
    target, draft = out / f"fixture-{family}.gguf", out / f"fixture-{family}-random-draft.gguf"
    if not draft.exists():
        hf = fixtures.tiny_target_hf(out / f"fixture-{family}-hf", fixtures.TinyTargetConfig(family=family))
        fixtures.tiny_target_gguf(hf, target, family=family)
        draft_hf = fixtures.tiny_draft_hf(out / f"fixture-{family}-random-draft-hf", hf,
                                          fixtures.TinyDraftConfig(**ROLLBACK_DRAFT))
        convert(draft_hf, target, draft, outtype="f32")
    return target, draft


def rollback_check(out_dir: str | Path, *, runs: int = 6, n_max: int = 7, n_predict: int = 48, threads: int = 1,
                   family: str = "qwen35", exe: str | Path | None = None) -> dict:
    """A random draft is never accepted, so every verify of n_max + 1 tokens rolls the target back by
    n_max. Serves PROMPTS with it `runs` times at -np 1 and at -np 8 (--kv-unified) and counts the
    runs in which some text differs from the plain target's greedy text (-np 1, no draft). `exe`:
    another build of llama-server (the patched one) for the drafted runs."""
    target, draft = fixture_pair(out_dir, family)
    prompts = [(str(i), p) for i, p in enumerate(PROMPTS)]
    ref = serve(target, None, PROMPTS, n_predict=n_predict, n_max=None, parallel=1, threads=threads).texts
    out = {"target": str(target), "draft": str(draft), "n_max": n_max, "runs": runs,
           "server": str(exe) if exe else "pinned"}
    for parallel in PARALLEL:
        differing = []
        for _ in range(runs):
            with server.LlamaServer(target, draft, threads=threads, n_ctx=256, n_parallel=parallel, n_max=n_max,
                                    extra_args=["--kv-unified"], exe=exe) as srv:
                res = server.load_test(srv.url, prompts, n_predict, parallel)
            differing.append([int(r.prompt_id) for r in res.requests if r.text != ref[int(r.prompt_id)]])
        out[f"np{parallel}"] = differing
    return out


UBATCH_PARALLEL = 4  # slots drafting together in the ubatch check


def ubatch_check(out_dir: str | Path, *, ubatch: int, parallel: int, n_max: int = 7, n_predict: int = 16,
                 threads: int = 1, exe: str | Path | None = None) -> dict:
    """The dense tiny fixture pair served at `-np parallel -ub ubatch` with a random draft of blocks of
    n_max + 1: whether the server lived through PROMPTS (`parallel` in flight) and how many texts are
    the plain target's (U19: blocks drafted together past -ub abort the pinned server)."""
    target, draft = fixture_pair(out_dir, "qwen3")
    prompts = [(str(i), p) for i, p in enumerate(PROMPTS)]
    ref = serve(target, None, PROMPTS, n_predict=n_predict, n_max=None, parallel=1, threads=threads).texts
    out = {"ubatch": ubatch, "parallel": parallel, "n_max": n_max, "server": str(exe) if exe else "pinned",
           "prompts": len(prompts)}
    try:
        with server.LlamaServer(target, draft, threads=threads, n_ctx=256, n_parallel=parallel, n_max=n_max,
                                extra_args=["-ub", str(ubatch)], exe=exe) as srv:
            res = server.load_test(srv.url, prompts, n_predict, parallel)
        out["served"] = True
        out["same_as_plain"] = sum(r.text == ref[int(r.prompt_id)] for r in res.requests)
    except (OSError, server.ServerError) as e:  # the server died: the connection closed, or it exited
        out["served"] = False
        out["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.bench.serving_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("serving-check"),
                   help="folder for the pair (built once, reused) and serving_check.json (default: ./serving-check)")
    p.add_argument("--variants", default="dflash,dflash2", help="drafts to serve: dflash, dflash2 (comma-separated)")
    p.add_argument("-n", "--n-predict", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--n-max", default="3,7", type=lambda t: int_list(t, "--n-max", 1),
                   help="--spec-draft-n-max values (default 3,7)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads of training and of the server (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs at -np 8 per draft and n-max (default 3)")
    p.add_argument("--rollback-check", type=int, nargs="?", const=6, default=0, metavar="RUNS",
                   help="instead: the tiny qwen35 fixture target with a random draft (every verify rolls back), "
                        "RUNS times (default 6) at -np 1 and 8; writes rollback_check.json")
    p.add_argument("--patched", action="store_true",
                   help="with --rollback-check or --ubatch-check: llama-server built from the pinned tree with "
                        "patches/series (built once, cached): U11's or U19's patch shown")
    p.add_argument("--ubatch-check", type=int, metavar="UB",
                   help="instead: the dense tiny fixture pair, random draft, at -ub UB with -np 4 (blocks of n-max "
                        "+ 1 drafted together); writes ubatch_check.json, exit status 1 if the server died")
    p.add_argument("--server", type=Path,
                   help="with --rollback-check or --ubatch-check: this llama-server binary (another build)")
    args = p.parse_args(argv)
    if (args.patched or args.server) and not (args.rollback_check or args.ubatch_check):
        p.error("--patched and --server go with --rollback-check or --ubatch-check")
    if args.server and not args.server.is_file():
        p.error(f"--server {args.server}: no such file")
    if args.rollback_check:
        return _print_rollback_check(args)
    if args.ubatch_check is not None:
        if args.ubatch_check < 1:
            p.error(f"--ubatch-check {args.ubatch_check}: expected a ubatch of 1 or more")
        return _print_ubatch_check(args)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in ("dflash", "dflash2")]
    if bad or not variants:
        p.error(f"--variants: expected dflash and/or dflash2, got {args.variants!r}")
    if args.n_predict < 1 or args.threads < 1 or args.repeats < 1:
        p.error("-n, -t and --repeats must be positive")
    target, drafts = build_pair(args.out, variants, threads=args.threads)
    rows = measure(target, drafts, n_predict=args.n_predict, n_maxes=args.n_max, threads=args.threads,
                   repeats=args.repeats)
    rows_needed = {v: row_check(target, d, n_predict=args.n_predict, threads=args.threads) for v, d in drafts.items()}
    record = {"rows": [{**r.__dict__, "draft_n": r.draft_n, "draft_n_accepted": r.draft_n_accepted,
                        "acceptance": r.acceptance} for r in rows], "row_check": rows_needed}
    (args.out / "serving_check.json").write_text(json.dumps(record, indent=1))
    print(table(rows))
    print()
    for v, c in rows_needed.items():
        print(f"{v}: tokens accepted in a row per block (our runtime, {c['anchors']} anchors): "
              f"{c['own_rows']:.2f} with the request's own target rows, {c['neighbour_rows']:.2f} with its "
              f"neighbour's")
    return 0


def _print_rollback_check(args: argparse.Namespace) -> int:
    """Exit status: 1 when -np 8 changed a text that -np 1 did not, else 0."""
    args.out.mkdir(parents=True, exist_ok=True)
    exe = patched_server() if args.patched else args.server
    out = rollback_check(args.out, runs=args.rollback_check, n_max=max(args.n_max), n_predict=args.n_predict,
                         threads=args.threads, exe=exe)
    (args.out / "rollback_check.json").write_text(json.dumps(out, indent=1))
    for parallel in PARALLEL:
        runs = out[f"np{parallel}"]
        print(f"-np {parallel}, random draft, --spec-draft-n-max {out['n_max']}: {sum(map(bool, runs))} of "
              f"{len(runs)} runs with a text that is not the plain target's (requests per run: {runs})")
    return int(any(out["np8"]) and not any(out["np1"]))


def _print_ubatch_check(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    exe = patched_server() if args.patched else args.server
    out = ubatch_check(args.out, ubatch=args.ubatch_check, parallel=UBATCH_PARALLEL, n_max=max(args.n_max),
                       n_predict=args.n_predict, threads=args.threads, exe=exe)
    (args.out / "ubatch_check.json").write_text(json.dumps(out, indent=1))
    print(f"-np {out['parallel']} -ub {out['ubatch']}, random draft, --spec-draft-n-max {out['n_max']}: " + (
        f"served, {out['same_as_plain']} of {out['prompts']} texts the plain target's" if out["served"]
        else f"the server died ({out['error']})"))
    return 0 if out["served"] else 1


def patched_server() -> Path:
    from dflash_llama.patchbuild import patched_build

    return patched_build().tool("llama-server")


if __name__ == "__main__":
    sys.exit(main())
