"""What a DFlash 2 draft's candidate selector changes, measured: at every position of the target's
greedy continuations of HumanEval prompts, the draft's block anchored there is drafted twice from
the same forward, by the selector's greedy walk and by the argmax of each slot's logits (what a
DFlash 1 draft of the same backbone would propose), and each is scored by how many of its tokens
the target's own continuation accepts.

    python -m dflash_llama.train.selector_study -m TARGET.gguf -md DRAFT_DIR [--limit 20] [-n 128]

Prints, and writes with --out as JSON: the share of drafted slots where the walk and the argmax
differ, the mean accepted length of both (tokens accepted in a row from the anchor, averaged over
anchors: an every-position replay, not the loop's tau), and the selector's score terms beside the
unary logits they are added to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def accepted(drafted: list[int], truth: list[int]) -> int:
    """How many leading drafted tokens equal the target's next tokens."""
    n = 0
    while n < len(drafted) and n < len(truth) and drafted[n] == truth[n]:
        n += 1
    return n


def study(target: Path, draft_dir: Path, prompts: list[str], n_predict: int, threads: int = 1,
          progress: bool = True) -> dict:
    import torch
    from tqdm import tqdm

    from dflash_llama.reference.checkpoint import load_draft
    from dflash_llama.reference.target import Target, gguf_vocab_tables
    from dflash_llama.runtime import Runtime

    torch.set_num_threads(threads)
    rt = Runtime(target, n_threads=threads, n_ctx=2048)
    embed, head, _ = gguf_vocab_tables(target, lazy=False)
    draft = load_draft(draft_dir, embed, head)
    if draft.candidate_selector is None:
        raise ValueError(f"{draft_dir}: a {draft.config.variant.title} draft has no candidate selector")
    ref = Target.load(target)
    block, mask = draft.block_size, draft.mask_token_id
    slots = differ = anchors = walk_sum = argmax_sum = 0
    gain = [0, 0]  # anchors where the walk accepted more / fewer than the argmax
    for text in tqdm(prompts, desc="selector study", disable=not progress):
        tokens = rt.tokenize(text)
        cont = rt.autoregressive(tokens, n_predict, stop_at_eog=False).tokens
        full = tokens + cont
        with torch.no_grad():
            feats = ref.forward(full, 0, ref.new_cache(), feature_layers=draft.target_layer_ids).features.float()
            cache, held = draft.new_cache(), 0
            for start in range(len(tokens), len(full) - 1):
                blk = torch.tensor([full[start]] + [mask] * (block - 1))
                y = draft.block_states(feats[held:start], blk, start, cache)
                held = start
                logits = draft.block_logits(y)
                walk = draft.candidate_selector.walk(y[1:], logits, full[start]).tokens.tolist()
                arg = logits.argmax(-1).tolist()
                truth = full[start + 1:start + block]
                a, b = accepted(walk, truth), accepted(arg, truth)
                walk_sum, argmax_sum, anchors = walk_sum + a, argmax_sum + b, anchors + 1
                gain[0] += a > b
                gain[1] += a < b
                slots += len(walk)
                differ += sum(x != z for x, z in zip(walk, arg))
    return {"target": str(target), "draft": str(draft_dir), "prompts": len(prompts), "n_predict": n_predict,
            "block_size": block, "anchors": anchors, "drafted_slots": slots,
            "walk_differs_from_argmax": differ / slots if slots else None,
            "mean_accepted_walk": walk_sum / anchors if anchors else None,
            "mean_accepted_argmax": argmax_sum / anchors if anchors else None,
            "anchors_walk_accepts_more": gain[0], "anchors_walk_accepts_fewer": gain[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.train.selector_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", dest="target", type=Path, required=True, help="target GGUF")
    p.add_argument("-md", "--model-draft", dest="draft", type=Path, required=True, help="DFlash 2 draft (HF dir)")
    p.add_argument("--limit", type=int, default=20, help="HumanEval prompts, spread over the set (default 20)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="target tokens per prompt (default 128)")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    from dflash_llama import prompts

    try:
        res = study(args.target, args.draft, [x.text for x in prompts.spread(prompts.humaneval(), args.limit)],
                    args.n_predict, args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"selector_study: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
