"""`dflash-llama generate`: speculative decoding with a DFlash draft, one engine at a time.

Every engine takes the same request and answers with the same JSON object, so their outputs can
be diffed:

    {"tokens": [generated ids, prompt excluded], "text": str,
     "steps": [{"drafted": [ids], "accepted": a, "produced": p}, ...], "tau": mean produced,
     "prompt_ids": [ids the engine fed the target]}

`--no-draft` decodes with the target alone: one step per token after the first, nothing drafted.
Engines: `reference` (PyTorch, dflash_llama.reference) and `runtime` (the C++ runtime).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from .bench.cost_model import parse_draft_max

ENGINES = ("reference", "runtime")


class EngineUnavailable(RuntimeError):
    """The chosen engine cannot run in this build."""


@dataclass(frozen=True)
class GenerateRequest:
    target: str
    draft: str | None  # None: plain target decoding
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    block_size: int | None  # None: the draft's own
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    draft_max: int | str | None = None  # runtime: verify at most this many drafted tokens, or "auto"
    threads: int = 0  # runtime: CPU threads, 0 = all
    n_ctx: int = 4096  # runtime: context size
    kv_f32: bool = False  # runtime: f32 KV cache, no flash attention (for comparisons with the reference)

    def __post_init__(self):  # cheap checks before any engine loads a model
        if self.max_tokens < 1:
            raise ValueError(f"-n must be >= 1, got {self.max_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.temperature < 0:
            raise ValueError(f"--temp must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if self.draft_max not in (None, "auto") and self.draft_max < 1:
            raise ValueError(f"--draft-max must be >= 1, got {self.draft_max}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="reference",
                   help="reference: PyTorch; runtime: the C++ runtime (default: reference)")
    p.add_argument("--target", required=True, help="target model: HF directory or .gguf")
    p.add_argument("--draft", help="DFlash draft: HF directory or .gguf")
    p.add_argument("--no-draft", action="store_true", help="decode with the target alone")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text (tokenised by the target's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma separated: 1,2,3")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="max new tokens (default 64)")
    p.add_argument("--block-size", type=int, help="verify block size (default: the draft's)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature, 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation")
    p.add_argument("--draft-max", type=parse_draft_max,
                   help="runtime: verify at most N drafted tokens per step; auto: the fastest N measured on "
                        "this machine and prompt")
    p.add_argument("-t", "--threads", type=int, default=0, help="runtime: CPU threads (default: all)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="runtime: context size (default 4096)")
    p.add_argument("--kv-f32", action="store_true",
                   help="runtime: f32 KV cache and no flash attention, to compare with the reference in f32")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_engine(engine: str, req: GenerateRequest) -> dict:
    """The one place that picks an engine; each returns the JSON schema above."""
    runners = {"reference": _run_reference, "runtime": _run_runtime}
    return runners[engine](req)


def _run_reference(req: GenerateRequest) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from .reference import (Sampling, Target, generate_autoregressive, generate_speculative,
                            load_draft_for_target)

    torch.manual_seed(req.seed)
    hf_logging.disable_progress_bar()
    target = Target.load(req.target)
    if req.prompt_ids is not None:
        prompt_ids = req.prompt_ids
    else:
        prompt_ids = target.tokenizer(req.prompt_text)["input_ids"]
    sampling = Sampling(req.temperature, req.top_p, req.top_k, req.seed)
    stop = [] if req.ignore_eos else target.eos_token_ids
    if req.draft is None:
        result = generate_autoregressive(target, prompt_ids, req.max_tokens, sampling=sampling,
                                         stop_token_ids=stop)
    else:
        draft = load_draft_for_target(req.draft, target)
        result = generate_speculative(target, draft, prompt_ids, req.max_tokens,
                                      block_size=req.block_size, sampling=sampling,
                                      stop_token_ids=stop)
    out = result.to_json_dict(text=target.tokenizer.decode(result.tokens))
    out["prompt_ids"] = list(prompt_ids)
    return out


def _run_runtime(req: GenerateRequest) -> dict:
    import tempfile
    from pathlib import Path

    from .runtime import Runtime

    if Path(req.target).is_dir():
        raise ValueError(f"--engine runtime reads the target through llama.cpp: give a .gguf, not the "
                         f"directory {req.target}")
    with tempfile.TemporaryDirectory(prefix="dflash-llama-") as tmp:
        draft = req.draft
        if draft is not None and Path(draft).is_dir():  # an HF checkpoint: convert it for this run
            from .converter import convert

            draft = str(convert(draft, req.target, Path(tmp) / "draft-f32.gguf", outtype="f32"))
        rt = Runtime(req.target, draft, n_threads=req.threads, n_ctx=req.n_ctx, kv_f32=req.kv_f32)
        prompt_ids = req.prompt_ids if req.prompt_ids is not None else rt.tokenize(req.prompt_text)
        kw = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                  stop_at_eog=not req.ignore_eos)
        if draft is None:
            result = rt.autoregressive(prompt_ids, req.max_tokens, **kw)
        else:
            from .bench.cost_model import resolve_draft_max

            draft_max = resolve_draft_max(rt, req.draft_max, list(prompt_ids), req.block_size,
                                          "dflash-llama generate")
            result = rt.generate(prompt_ids, req.max_tokens, block_size=req.block_size, draft_max=draft_max, **kw)
    out = result.to_json()
    if draft is None:  # the shared schema: one step per target decode after the first token
        out["steps"] = [{"drafted": [], "accepted": 0, "produced": 1}] * (len(result.tokens) - 1)
        out["tau"] = 1.0 if out["steps"] else 0.0
    out["prompt_ids"] = list(prompt_ids)
    return out


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def main(args: argparse.Namespace) -> int:
    err = lambda msg: print(f"dflash-llama generate: {msg}", file=sys.stderr)  # noqa: E731
    if args.no_draft == (args.draft is not None):
        err("give --draft D, or --no-draft for plain target decoding")
        return 2
    if args.no_draft and args.block_size is not None:
        err("--block-size needs a draft")
        return 2
    try:
        req = GenerateRequest(
            target=args.target,
            draft=None if args.no_draft else args.draft,
            prompt_text=args.prompt,
            prompt_ids=None if args.prompt_ids is None else _parse_ids(args.prompt_ids),
            max_tokens=args.n_predict,
            block_size=args.block_size,
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            draft_max=args.draft_max,
            threads=args.threads,
            n_ctx=args.ctx_size,
            kv_f32=args.kv_f32,
        )
        t0 = time.perf_counter()
        out = run_engine(args.engine, req)
        seconds = time.perf_counter() - t0
    except EngineUnavailable as e:
        err(str(e))
        return 2
    except (FileNotFoundError, ValueError) as e:
        err(str(e))
        return 1

    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        print(f"[{args.engine}] {len(out['tokens'])} tokens, {len(out['steps'])} steps, "
              f"tau {out['tau']:.3f}, {seconds:.2f} s (loading included)", file=sys.stderr)
    return 0
