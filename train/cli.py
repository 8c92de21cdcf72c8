"""`dflash-llama train`: build the dataset with the target itself, then train a draft on it.

    dflash-llama train -m SmolLM2-135M-Instruct.Q4_1.gguf --out drafts/smollm2 \\
        --layers 2 --block-size 8 --target-layer-ids 1,8,14,20,27 --epochs 4

Both stages resume where they stopped: run the same command again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from dflash_llama.cli_args import add_model_args, add_seed_arg, add_threads_arg, finite_float
from dflash_llama.schema import DFLASH1, DFLASH2, DSPARK, VARIANTS

# each variant's own settings: flag, default, type, what it sets (given with another --variant: an error)
VARIANT_FLAGS = {
    DFLASH2.name: (("--conv-kernel-size", 2, int, "taps of each convolution"),
                   ("--conv-group-size", 16, int, "channels sharing one dynamic coefficient (divides the hidden "
                                                  "size)"),
                   ("--selector-rank", 64, int, "rank of the selector's codebooks"),
                   ("--selector-top-k", 8, int, "candidates the selector walks per draft slot")),
    DSPARK.name: (("--markov-rank", 64, int, "rank of the Markov head (the paper's default is 256)"),
                  ("--confidence-head", "on", ("on", "off"), "a confidence head (predicts each slot's acceptance)"),
                  ("--block-layout", "anchor-first", ("anchor-first", "dflash"),
                   "anchor-first: B inputs give B drafts (DSpark's); dflash: B - 1, as DFlash 1 (so --init of a "
                   "DFlash 1 draft starts from its drafts)"),
                  ("--tv-weight", 0.9, float, "the loss: (1 - W) x the draft loss + W x total variation (paper: "
                                              "0.1 CE + 0.9 TV)"),
                  ("--confidence-weight", 1.0, float, "weight of the confidence head's BCE on the analytic "
                                                      "acceptance 1 - TV"),
                  ("--head-lr-scale", 10.0, float, "learning rate of the Markov and confidence heads, in "
                                                   "multiples of --lr")),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, target_required=True, target_help="target model (GGUF)")
    p.add_argument("--out", required=True, type=Path, help="output folder for the draft (HF format)")
    p.add_argument("--data", type=Path, help="dataset folder (default: OUT/data); built if missing")
    p.add_argument("--extra-data", type=Path, action="append", default=[],
                   help="another dataset folder (same target layers) to train on as well; repeatable")
    p.add_argument("--prompts", type=int, default=0, help="number of training prompts (default: all)")
    p.add_argument("--prompt-offset", type=int, default=0,
                   help="skip this many prompts of the (seeded, shuffled) list: datasets built in parallel")
    p.add_argument("--packages", default="", help="installed packages to take prompts from, besides the "
                   "standard library (comma-separated)")
    p.add_argument("--no-stdlib", action="store_true", help="take no prompts from the standard library")
    p.add_argument("--with-examples", action="store_true",
                   help="only functions whose docstring shows doctest examples (>>>), as HumanEval's do")
    p.add_argument("--prompt-style", choices=("docstring", "humaneval"), default="docstring",
                   help="docstring: signature and whole docstring; humaneval: signature, summary paragraph "
                        "and up to three doctest examples after a blank line, as HumanEval's prompts "
                        "(functions without examples are skipped). With --prompt-source self: docstring "
                        "leaves the docstring open for the response; humaneval has the target sample it "
                        "(every second one with doctest examples) and closes it, as HumanEval's prompts end")
    p.add_argument("--prompt-source", choices=("code", "self"), default="code",
                   help="code: functions documented in the standard library and --packages; self: exercises the "
                        "target writes itself (it samples function signatures, each prompt opens the docstring; "
                        "see train_data.self_prompts). Parallel builds of self prompts: seeds 100000 apart")
    p.add_argument("--build-only", action="store_true", help="build the dataset (--data) and stop")
    p.add_argument("-md", "--model-draft", "--init", dest="init", type=Path, metavar="DRAFT_DIR",
                   help="start from this draft checkpoint (HF folder) instead of random weights: fine-tuning on "
                        "more data; one with fewer layers than --layers grows (the new layers start as identities)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="target response length per prompt")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--target-layer-ids", default="", help="target layers the draft reads, e.g. 1,8,14,20,27 "
                   "(default: the published rule for --layers)")
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--ffn", type=int, default=0, help="draft MLP width (default: the target's)")
    p.add_argument("--epochs", type=finite_float, default=4.0)
    p.add_argument("--lr", type=finite_float, default=6e-4)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--gamma", type=finite_float, default=0.0,
                   help="position weights exp(-(k-1)/gamma) of block position k (default: the published 4 for "
                        "--block-size 8, 7 for 16; smaller puts the weight on the first drafted tokens)")
    p.add_argument("--vocab-subset", type=int, default=8192,
                   help="tokens in the loss's vocabulary (0: all; the held-out estimate always uses all)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="K",
                   help="a reduced draft vocabulary: the K most frequent response tokens (and the end-of-generation "
                        "tokens), saved as d2t; the loss is over them too (default 0: the whole vocabulary)")
    p.add_argument("--distill", type=finite_float, default=0.0, metavar="W",
                   help="weight of KL(target || draft) on the target's whole next-token distribution against "
                        "cross-entropy on its greedy token (0: cross-entropy only). The target's logits come from "
                        "its deepest captured layer through its remaining layers, run in PyTorch (llama, qwen3)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default=DFLASH1.name,
                   help="draft variant: dflash (DFlash 1), dflash2 (DFlash 2: grouped dynamic convolutions around "
                        "every sublayer and a candidate selector, trained with its own loss; --init of a DFlash 1 "
                        "draft starts from identity convolutions, so step 0 drafts what that draft drafts) or dspark "
                        "(DSpark: a Markov head on the logits and a confidence head, the paper's loss; --init of a "
                        "DFlash 1 draft with --block-layout dflash starts from a zero Markov bias)")
    for variant, flags in VARIANT_FLAGS.items():
        title = VARIANTS[variant].title
        for flag, default, kind, what in flags:
            if isinstance(kind, tuple):
                p.add_argument(flag, choices=kind, default=None, help=f"{title}: {what} (default {default})")
            else:
                p.add_argument(flag, type=finite_float if kind is float else kind, default=None,
                               help=f"{title}: {what} (default {default})")
    p.add_argument("--eval-every", type=int, default=200)
    add_seed_arg(p, "seed of the prompt list, the target's sampling and training")
    add_threads_arg(p)
    p.add_argument("--evaluate", action="store_true",
                   help="after training, evaluate on HumanEval: our runtime, llama.cpp's draft-dflash (checkpoint "
                        "converted by the pinned converter) and the dflash package; writes OUT/eval.json")
    p.add_argument("--eval-only", action="store_true", help="evaluate the checkpoint in --out, train nothing")
    p.add_argument("--eval-prompts", type=int, default=164, help="HumanEval prompts for the evaluation")
    p.add_argument("--eval-published-prompts", type=int, default=40,
                   help="of those, how many the (slow) dflash package decodes")
    p.add_argument("--eval-engines", default="runtime,native,published",
                   help="engines to evaluate, comma-separated (default: runtime,native,published)")


def main(args: argparse.Namespace) -> int:
    target = Path(args.target)
    layer_ids = _check_arguments(args, target)
    if args.eval_only:
        return _evaluate(args, target)
    data = args.data or args.out / "data"
    _build_dataset(args, target, data, layer_ids)
    if args.build_only:
        return 0
    _train(args, target, data, layer_ids)
    return _evaluate(args, target) if args.evaluate else 0


def _check_arguments(args: argparse.Namespace, target: Path) -> list[int]:
    """The target layers the draft reads; ValueError (exit 2) for any bad argument, before any work."""
    import dflash_llama
    from dflash_llama.reference.model import default_target_layer_ids

    if target.is_dir():
        raise ValueError("training reads the target through llama.cpp: give its GGUF (convert an HF directory "
                         "with llama.cpp's convert_hf_to_gguf.py first)")
    n_layers = int(dflash_llama.gguf_info(target).block_count)
    if args.target_layer_ids:
        try:
            layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            raise ValueError(f"--target-layer-ids must be integers, got {args.target_layer_ids!r}") from None
    else:
        layer_ids = default_target_layer_ids(n_layers, args.layers)
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"target layer {bad[0]} is outside the target's {n_layers} layers")
    if args.block_size < 2:
        raise ValueError("--block-size must be at least 2")
    if args.gamma < 0:
        raise ValueError(f"--gamma must be positive (0: the published value), got {args.gamma}")
    if not 0.0 <= args.distill <= 1.0:
        raise ValueError(f"--distill is a weight between 0 and 1, got {args.distill}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be 0 (the whole vocabulary) or a number of tokens, "
                         f"got {args.draft_vocab}")
    engines = tuple(e for e in args.eval_engines.split(",") if e)
    if set(engines) - {"runtime", "native", "published"} or not engines:
        raise ValueError(f"--eval-engines takes runtime, native, published; got {args.eval_engines!r}")
    args.eval_engines = engines
    _check_variant(args, target)
    if args.init is not None and not (args.init / "config.json").exists():
        raise FileNotFoundError(f"--init {args.init}: no draft checkpoint there (config.json)")
    if args.prompt_source == "self" and not args.prompts and not args.eval_only:
        raise ValueError("--prompt-source self needs --prompts N (how many exercises the target writes)")
    return layer_ids


def _check_variant(args: argparse.Namespace, target: Path) -> None:
    """A variant's flags only with its --variant; there, their defaults filled in and checked (the others'
    set to "none": 0)."""
    for variant, flags in VARIANT_FLAGS.items():
        for flag, default, kind, _ in flags:
            dest = flag[2:].replace("-", "_")
            if args.variant != variant:
                if getattr(args, dest) is not None:
                    raise ValueError(f"{flag} is a {VARIANTS[variant].title} setting: give --variant {variant}")
                setattr(args, dest, 0)
                continue
            if getattr(args, dest) is None:
                setattr(args, dest, default)
            value = getattr(args, dest)
            if kind is int and value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")
            if kind is float and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.variant == DFLASH2.name:
        _check_dflash2(args, target)
    if args.variant == DSPARK.name:
        if args.draft_vocab:
            raise ValueError("--draft-vocab with --variant dspark is not supported yet (a DSpark draft's Markov "
                             "head spans the whole vocabulary here)")
        if args.tv_weight > 1:
            raise ValueError(f"--tv-weight is a weight between 0 and 1, got {args.tv_weight}")


def _check_dflash2(args: argparse.Namespace, target: Path) -> None:
    import dflash_llama

    info = dflash_llama.gguf_info(target)
    n_embd = int(info.metadata.get(f"{info.architecture}.embedding_length", 0))
    if n_embd and n_embd % args.conv_group_size:
        raise ValueError(f"--conv-group-size {args.conv_group_size} does not divide the target's hidden size {n_embd}")
    n_vocab = len(info.metadata.get("tokenizer.ggml.tokens", ()))
    vocab, what = (args.draft_vocab, "--draft-vocab") if args.draft_vocab else (n_vocab, "the target's vocabulary")
    if vocab and args.selector_top_k > vocab:
        raise ValueError(f"--selector-top-k {args.selector_top_k} is larger than the draft vocabulary "
                         f"({what}: {vocab} tokens)")


def _prompt_source(args: argparse.Namespace) -> str:
    """What the dataset's prompts are, as the manifest records it: the list and the slice taken of it."""
    end = args.prompt_offset + args.prompts if args.prompts else ""
    style = f", style={args.prompt_style!r}" if args.prompt_style != "docstring" else ""
    if args.prompt_source == "self":
        return f"self_prompts(seed={args.seed}{style})[{args.prompt_offset}:{end}]"
    packages = [p for p in args.packages.split(",") if p]
    return (f"code_prompts(seed={args.seed}, packages={packages}, stdlib={not args.no_stdlib}, "
            f"with_examples={args.with_examples}{style})[{args.prompt_offset}:{end}]")


def _build_dataset(args: argparse.Namespace, target: Path, data: Path, layer_ids: list[int]) -> None:
    """The target's responses and features for this command's prompts (resumes an interrupted build)."""
    from dflash_llama.runtime import Runtime

    from .data import DatasetSpec, build_dataset, code_prompts

    source = _prompt_source(args)
    mismatch = _other_prompts(data, source)
    if mismatch:
        raise ValueError(f"{data} holds the responses to {mismatch}, not to this command's {source}: give the "
                         f"options it was built with (--packages, --no-stdlib, --with-examples, --prompt-style, "
                         f"--prompt-offset, --seed), or name it with --extra-data to train on it as it is")
    spec = DatasetSpec(target=str(target), layer_ids=layer_ids, max_new_tokens=args.max_new_tokens,
                       n_ctx=1024, source=source)
    how = "--target-layer-ids" if args.target_layer_ids else f"the published rule for --layers {args.layers}"
    print(f"dataset {data}: target features at layers {layer_ids} ({how})", file=sys.stderr)
    if args.prompt_source == "self":
        prompts = _target_written_prompts(target, data, args)
    else:
        prompts = code_prompts(seed=args.seed, packages=[p for p in args.packages.split(",") if p],
                               stdlib=not args.no_stdlib, with_examples=args.with_examples, style=args.prompt_style)
        prompts = prompts[args.prompt_offset:][:args.prompts or None]
    rt = Runtime(target, None, n_threads=args.threads, n_ctx=spec.n_ctx, n_batch=512)
    build_dataset(rt, prompts, data, spec)


def _train(args: argparse.Namespace, target: Path, data: Path, layer_ids: list[int]) -> None:
    """Train the draft into --out; writes OUT/train_log.json."""
    from .model_card import dataset_summary
    from .trainer import TrainConfig, cpu_has_bf16, train

    cfg = TrainConfig(target_layer_ids=layer_ids, layers=args.layers, block_size=args.block_size,
                      mask_token_id=args.mask_token_id, ffn=args.ffn, epochs=args.epochs, lr=args.lr,
                      batch=args.batch, anchors=args.anchors, gamma=args.gamma, vocab_subset=args.vocab_subset,
                      draft_vocab=args.draft_vocab,
                      distill=args.distill, eval_every=args.eval_every, seed=args.seed,
                      conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                      selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                      markov_rank=args.markov_rank, confidence_head=args.confidence_head == "on",
                      sample_from_anchor=args.block_layout == "anchor-first",
                      **({"tv_weight": args.tv_weight, "confidence_weight": args.confidence_weight,
                          "head_lr_scale": args.head_lr_scale} if args.variant == DSPARK.name else {}),
                      bf16=cpu_has_bf16())  # resolved here so that train_log.json records it
    log = train([data, *args.extra_data], target, args.out, cfg, threads=args.threads, init=args.init)
    summary = {"steps": log.steps[-1] if log.steps else 0, "final_loss": log.loss[-1] if log.loss else None,
               "heldout_tau": log.heldout_tau[-1][1] if log.heldout_tau else None, "wall_s": round(log.wall_s, 1)}
    kept = json.loads((args.out / "config.json").read_text()).get("draft_vocab_size")
    if kept:  # --draft-vocab K keeps at most K: no more than the responses use
        summary["draft_vocab_size"] = kept
    init_log = args.init / "train_log.json" if args.init else None
    record = {**summary, "command": "dflash-llama train " + " ".join(sys.argv[2:]), "config": asdict(cfg),
              "data": [str(d) for d in [data, *args.extra_data]],
              "datasets": [dataset_summary(d) for d in [data, *args.extra_data]],
              "init": json.loads(init_log.read_text()) if init_log and init_log.exists() else None,
              "loss": log.loss, "heldout_tau_curve": log.heldout_tau}
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(summary))


def _target_written_prompts(target: Path, data: Path, args: argparse.Namespace) -> list[str]:
    """self_prompts for this command, written once to DATA/prompts.json (sampling them again on a resume
    would cost minutes; the file also shows what the dataset was built from)."""
    from dflash_llama.runtime import Runtime

    from .data import self_prompts

    saved = data / "prompts.json"
    want = args.prompt_offset + args.prompts
    if saved.exists():
        prompts = json.loads(saved.read_text())
        if len(prompts) >= want:
            return prompts[args.prompt_offset:want]
    rt = Runtime(target, None, n_threads=args.threads, n_ctx=2048, n_batch=512, n_seq=16)
    prompts = self_prompts(rt, want, seed=args.seed, batch=16, style=args.prompt_style)
    del rt
    data.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(".tmp")
    tmp.write_text(json.dumps(prompts, indent=0))
    tmp.replace(saved)
    return prompts[args.prompt_offset:want]


def _other_prompts(data: Path, source: str) -> str | None:
    """The prompt list an existing dataset was built from, when it is not `source`'s (the slice's end
    may differ: a dataset grows by asking for more prompts of the same list)."""
    manifest = data / "manifest.json"
    if not manifest.exists():
        return None
    theirs = json.loads(manifest.read_text()).get("source")
    if not theirs:  # built before datasets recorded their prompts
        return None
    start = lambda s: s[:s.rindex(":")]  # noqa: E731  "code_prompts(...)[offset"
    return None if start(theirs) == start(source) else theirs


def _evaluate(args: argparse.Namespace, target: Path) -> int:
    from .eval import evaluate

    # the model card's datasets: those named, else OUT/data where training built it; train_log.json
    # records the datasets of every stage, so none is needed for a checkpoint trained by this command
    card_data = ([args.data] if args.data else [args.out / "data"] if (args.out / "data").is_dir() else [])
    card_data += args.extra_data
    for d in card_data:
        if not (d / "manifest.json").exists():
            raise FileNotFoundError(f"{d}: not a dataset (no manifest.json)")
    if not (args.out / "config.json").exists():
        raise FileNotFoundError(f"no checkpoint in {args.out} to evaluate")
    ev = evaluate(args.out, target, args.out, n_prompts=args.eval_prompts, n_published=args.eval_published_prompts,
                  block_size=args.block_size, threads=args.threads,
                  engines=args.eval_engines)
    print(ev.markdown())
    from .model_card import write_model_card

    card = write_model_card(args.out, card_data)
    print(f"model card: {card}")
    return 0 if all(s.exact is not False for s in ev.scores) else 3
