"""`dflash-llama generate`: speculative decoding with a DFlash draft, one engine at a time.

Every engine takes the same request and answers with the same JSON object, so their outputs can
be diffed:

    {"tokens": [generated ids, prompt excluded], "text": str,
     "steps": [{"drafted": [ids], "accepted": a, "produced": p}, ...], "tau": mean produced,
     "prompt_ids": [ids the engine fed the target]}

`--no-draft` decodes with the target alone: one step per token after the first, nothing drafted.
Engines: `runtime` (the C++ runtime, default) and `reference` (PyTorch, dflash_llama.reference).
Each engine checks the request itself (the runtime in C++, the reference in reference/speculative.py);
this front end only reports what they raise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from .cli_args import (
    CTX_SIZE,
    add_block_size_arg,
    add_draft_max_arg,
    add_draft_p_min_arg,
    add_generation_args,
    add_model_args,
    add_sampling_args,
)

ENGINES = ("runtime", "reference")


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
    draft_max: int | str = "auto"  # runtime: verify at most this many drafted tokens, or "auto"
    ngram: bool | None = None  # runtime: the adaptive loop's n-gram source (None: on with "auto")
    draft_p_min: float = 0.0  # a DSpark draft's confidence threshold (0: none)
    confidence: bool | None = None  # runtime: the adaptive loop's confidence gate (None: on with a head)
    threads: int | None = None  # runtime: CPU threads (0: all); None: measured
    n_ctx: int = CTX_SIZE  # runtime: context size
    n_gpu_layers: int = 0  # runtime: target layers on the GPU (-1: all)
    kv_f32: bool = False  # runtime: f32 KV cache, no flash attention (for comparisons with the reference)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="runtime",
                   help="runtime: the C++ runtime (default); reference: PyTorch")
    add_model_args(p, target_required=True,
                   target_help="target model: .gguf (reference engine: also an HF directory)",
                   draft_help="DFlash draft: .gguf, or HF directory (runtime engine: converted to f32 once "
                              "and cached)")
    p.add_argument("--no-draft", action="store_true", help="decode with the target alone")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text (tokenised by the target's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma separated: 1,2,3")
    add_generation_args(p, measured_threads=True)  # -n, -t, -c (threads and context: runtime engine)
    add_block_size_arg(p)
    add_sampling_args(p)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation")
    add_draft_max_arg(p)
    add_draft_p_min_arg(p)
    p.add_argument("--kv-f32", action="store_true",
                   help="runtime: f32 KV cache, no flash attention and the target's own head for the draft, to "
                        "compare with the reference in f32")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_engine(engine: str, req: GenerateRequest) -> dict:
    """The one place that picks an engine; each returns the JSON schema above."""
    runners = {"reference": _run_reference, "runtime": _run_runtime}
    return runners[engine](req)


def _run_reference(req: GenerateRequest) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from .reference import Sampling, Target, generate_autoregressive, generate_speculative, load_draft_for_target
    from .runtime import utf8_text

    sampling = Sampling(req.temperature, req.top_p, req.top_k, req.seed)  # checks them, before any loading
    if req.ngram is not None:
        raise ValueError("--ngram: the reference engine has no adaptive loop; --ngram is for --engine runtime")
    if req.confidence is not None:
        raise ValueError("--draft-confidence: the reference engine has no adaptive loop; it is for --engine runtime")
    if req.n_gpu_layers:
        raise ValueError(f"-ngl {req.n_gpu_layers}: the reference engine runs on the CPU; -ngl is for --engine runtime")
    prompt_text = None if req.prompt_text is None else utf8_text(req.prompt_text)
    torch.manual_seed(req.seed)
    hf_logging.disable_progress_bar()
    target = Target.load(req.target)
    if req.prompt_ids is not None:
        prompt_ids = req.prompt_ids
    else:
        prompt_ids = target.tokenizer(prompt_text)["input_ids"]
    stop = [] if req.ignore_eos else target.eos_token_ids
    if req.draft is None:
        result = generate_autoregressive(target, prompt_ids, req.max_tokens, sampling=sampling,
                                         stop_token_ids=stop)
    else:
        draft = load_draft_for_target(req.draft, target)
        result = generate_speculative(target, draft, prompt_ids, req.max_tokens,
                                      block_size=req.block_size, sampling=sampling,
                                      stop_token_ids=stop, confidence_threshold=req.draft_p_min)
    return result.to_json_dict(text=target.tokenizer.decode(result.tokens), prompt_ids=prompt_ids)


def _run_runtime(req: GenerateRequest) -> dict:
    from pathlib import Path

    from .converter.pair import resolve_draft
    from .runtime import Runtime

    if Path(req.target).is_dir():
        raise ValueError(f"--engine runtime reads the target through llama.cpp: give a .gguf, not the "
                         f"directory {req.target}")
    # f32: an HF draft decodes with its checkpoint's weights, as the reference engine does
    draft = None if req.draft is None else resolve_draft(req.draft, req.target, outtype="f32")
    # --kv-f32 compares with the reference: the draft proposes through the target's own head, as it does
    rt = Runtime(req.target, draft, n_threads=req.threads, n_ctx=req.n_ctx, kv_f32=req.kv_f32,
                 compact_draft_head=not req.kv_f32, n_gpu_layers=req.n_gpu_layers)
    prompt_ids = req.prompt_ids if req.prompt_ids is not None else rt.tokenize(req.prompt_text)
    kw = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
              stop_at_eog=not req.ignore_eos)
    if draft is None:
        result = rt.autoregressive(prompt_ids, req.max_tokens, **kw)
    else:
        result = rt.generate(prompt_ids, req.max_tokens, block_size=req.block_size, draft_max=req.draft_max,
                             ngram=req.ngram, draft_p_min=req.draft_p_min, confidence=req.confidence, **kw)
    return result.to_json(prompt_ids=prompt_ids)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def main(args: argparse.Namespace) -> int:
    if args.no_draft == (args.draft is not None):
        raise ValueError("give -md DRAFT, or --no-draft for plain target decoding")
    if args.no_draft and args.block_size is not None:
        raise ValueError("--block-size needs a draft")
    if args.no_draft and args.ngram is not None:
        raise ValueError("--ngram is a source of the adaptive loop: it needs a draft")
    if args.no_draft and (args.draft_p_min or args.draft_confidence is not None):
        flag = "--draft-p-min" if args.draft_p_min else "--draft-confidence"
        raise ValueError(f"{flag} reads a draft's confidence head: it needs a draft")
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
        ngram=args.ngram,
        draft_p_min=args.draft_p_min,
        confidence=args.draft_confidence,
        threads=args.threads,
        n_ctx=args.ctx_size,
        n_gpu_layers=args.n_gpu_layers,
        kv_f32=args.kv_f32,
    )
    t0 = time.perf_counter()
    out = run_engine(args.engine, req)
    seconds = time.perf_counter() - t0

    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        print(f"[{args.engine}] {len(out['tokens'])} tokens, {len(out['steps'])} steps, "
              f"tau {out['tau']:.3f}, {seconds:.2f} s (loading included)", file=sys.stderr)
    return 0
