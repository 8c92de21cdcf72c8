"""Training a small DFlash draft, per the published recipe, on a CPU.

The target is frozen and never runs here: its features were captured once (train_data.py) and
its token embeddings and LM head are read from its GGUF. Per sequence, random anchors a give
blocks [token a, MASK, ...] at positions a..a+B-1; each block sees the target features of tokens
before a and attends bidirectionally inside itself, never to another block. Block position k
predicts token a+k with weight exp(-(k-1)/gamma).

To fit a CPU, the loss normalises over a fixed subset of the vocabulary (the tokens the target
actually writes in the training data, plus every target token of the batch) instead of all of it:
the head matmul is the bulk of the cost, and tokens the target never writes carry no signal.
The held-out estimate of tau replays the speculative loop on the held-out sequences (greedy, full
vocabulary, blocks anchored where real decoding anchors them: `replay_tau`).

Checkpoints are the published HF format (config.json + model.safetensors, bf16), so our converter,
llama.cpp's converter and the `dflash` package all load them; `train_state.pt` makes it resumable.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from dflash_llama import schema as L
from dflash_llama.reference.gguf_tensors import TargetWeights, target_weights_from_gguf
from dflash_llama.reference.model import DFlashDraft, DraftConfig, GroupedDynamicConv, rope_cos_sin


@dataclass
class TrainConfig:
    target_layer_ids: list[int]
    layers: int = 2
    block_size: int = 8
    heads: int = 0  # 0: the target's
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    mask_token_id: int = 0
    epochs: float = 4.0
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    anchors: int = 32  # per sequence
    batch: int = 8  # sequences per optimizer step
    gamma: float = 0.0  # 0: 7 for B=16, 4 for B=8 (published), else B/2
    vocab_subset: int = 8192  # 0: full vocabulary in the loss
    draft_vocab: int = 0  # > 0: a reduced draft vocabulary (d2t) of the K most frequent response tokens
    heldout: int = 64  # sequences held out for the tau estimate
    heldout_measure: str = "replay"  # replay_tau on the held-out sequences ("teacher-forced" before it existed)
    eval_every: int = 200  # optimizer steps
    bf16: bool | None = None  # autocast matmuls to bf16 (weights stay f32); None: where the CPU has bf16 units
    distill: float = 0.0  # weight of KL(target || draft) against cross-entropy on the greedy token
    seed: int = 0
    # DFlash 2 (schema.DFLASH2) when conv_kernel_size > 0: its convolutions and candidate selector
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    selector_weight: float = 1.0  # weight of the selector's loss beside the draft loss
    # DSpark (schema.DSPARK) when markov_rank > 0: its Markov head, optional confidence head, block layout
    markov_rank: int = 0
    confidence_head: bool = False
    sample_from_anchor: bool = False
    tv_weight: float = 0.9  # the paper's loss: (1 - tv_weight) x the draft loss + tv_weight x TV + ...
    confidence_weight: float = 1.0  # ... + confidence_weight x BCE(confidence, 1 - TV)
    head_lr_scale: float = 10.0  # the DSpark heads' learning rate, in multiples of lr

    def resolved_gamma(self) -> float:
        if self.gamma > 0:
            return self.gamma
        return {16: 7.0, 8: 4.0}.get(self.block_size, self.block_size / 2)


def draft_config(cfg: TrainConfig, t: TargetWeights) -> DraftConfig:
    return DraftConfig(
        n_embd=t.embed_tokens.shape[1], n_ff=cfg.ffn or t.ffn, n_layer=cfg.layers,
        n_head=cfg.heads or t.n_heads, n_head_kv=cfg.kv_heads or t.n_kv_heads,
        head_dim=cfg.head_dim or t.head_dim, n_vocab=t.embed_tokens.shape[0],
        mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
        block_size=cfg.block_size, rms_eps=1e-6, rope_freq_base=t.rope_theta,
        n_layer_target=t.n_layers, n_ctx_train=8192, conv_kernel_size=cfg.conv_kernel_size,
        conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
        markov_rank=cfg.markov_rank, has_confidence_head=cfg.confidence_head,
        sample_from_anchor=cfg.sample_from_anchor)


def init_draft(dcfg: DraftConfig, seed: int) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(dcfg)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                p.fill_(1.0)
        for conv in draft.modules():
            if isinstance(conv, GroupedDynamicConv):
                identity_conv(conv)
        if draft.markov_head is not None:  # a zero bias to start from, rows of unit scale to move it
            torch.nn.init.normal_(draft.markov_head.markov_w1.weight, std=1.0)
            draft.markov_head.markov_w2.weight.zero_()
        if draft.confidence_head is not None:
            draft.confidence_head.proj.bias.zero_()
    return draft


def identity_conv(conv: GroupedDynamicConv) -> None:
    """A DFlash 2 convolution that passes its input through: tap 0 is 1, the other taps and the
    dynamic projection 0 (training moves them from there)."""
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.base_kernel[:, 0] = 1.0
        conv.kernel_projection.weight.zero_()


# --------------------------------------------------------------------------- batched forward

def block_hidden(draft: DFlashDraft, feats: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states of every anchor's block: [M, B, H].

    feats: [L, n_taps*H] the sequence's target features; tokens: [L]; anchors: [M] positions.
    """
    cfg = draft.config
    B, L, M = cfg.block_size, feats.shape[0], anchors.shape[0]
    dtype = draft.fc.weight.dtype
    ctx_pos = torch.arange(L)
    blk_pos = (anchors[:, None] + torch.arange(B)[None, :]).reshape(-1)  # [M*B]
    rope = (cfg.head_dim, cfg.rope_freq_base, dtype, cfg.rope_linear_factor or 1.0)
    ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, *rope)
    blk_cos, blk_sin = rope_cos_sin(blk_pos, *rope)

    # visibility: block m sees context before its anchor and its own block, nothing else
    block_of = torch.arange(M).repeat_interleave(B)
    sees_ctx = ctx_pos[None, :] < anchors.repeat_interleave(B)[:, None]  # [M*B, L]
    sees_blk = block_of[:, None] == block_of[None, :]  # [M*B, M*B]
    mask = torch.cat([sees_ctx, sees_blk], dim=1)

    block_ids = torch.full((M, B), cfg.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = tokens[anchors]
    scale = 1.0 if cfg.embedding_scale is None else cfg.embedding_scale
    x = F.embedding(block_ids.reshape(-1), draft.embed_tokens) * scale
    c = draft.hidden_norm(draft.fc(feats.to(dtype)))
    for layer in draft.layers:
        k_ctx, v_ctx = layer.context_kv(c, ctx_cos, ctx_sin)
        x = layer(x, k_ctx, v_ctx, ctx_pos, blk_pos, blk_cos, blk_sin, attn_mask=mask, block_len=B)
    return draft.norm(x).view(M, B, -1)


@dataclass
class Batch:
    tokens: torch.Tensor  # [L]
    feats: torch.Tensor  # [L, F]
    anchors: torch.Tensor  # [M]
    targets: torch.Tensor  # [M, n] (n drafted slots: B-1, or B anchor-first), -1 past the sequence end
    teacher: torch.Tensor | None = None  # [M, n, H] the target's final hidden state before each target


def attach_teacher(b: Batch, tail, tap: slice) -> Batch:
    """Give `b` the target's own final hidden states for its targets (see target_tail.py).

    tap: the columns of the features that hold the hidden state entering the tail's first layer.
    Block position k predicts token a+k, which the target predicted from position a+k-1.
    """
    final = tail.hidden(b.feats[:, tap])
    pos = (b.anchors[:, None] + torch.arange(b.targets.shape[1])[None, :]).clamp(max=len(final) - 1)
    b.teacher = final[pos]
    return b


def make_batch(tokens: np.ndarray, prompt_len: int, feats: np.ndarray, block_size: int, n_anchors: int,
               rng: random.Random, anchor_first: bool = False) -> Batch | None:
    """`n_anchors` random blocks of one sequence; anchor_first: slot 0 drafts too (B targets a block)."""
    L = len(tokens)
    candidates = list(range(max(prompt_len, 1), L - 1))  # anchors in the response, one target at least
    if not candidates:
        return None
    anchors = sorted(rng.sample(candidates, min(n_anchors, len(candidates))))
    tok = torch.from_numpy(tokens.astype(np.int64))
    anchors = torch.tensor(anchors)
    return Batch(tok, torch.from_numpy(feats.astype(np.float32)), anchors,
                 block_targets(tok, anchors, block_size, anchor_first))


def block_targets(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                  anchor_first: bool = False) -> torch.Tensor:
    """[M, n]: the j-th drafted slot of the block at anchor a predicts token a + j + 1 (n = B - 1, DFlash's
    slots 1..B-1; anchor-first n = B, slots 0..B-1); -1 past the end."""
    L = len(tokens)
    idx = anchors[:, None] + torch.arange(1, block_size + anchor_first)[None, :]
    return torch.where(idx < L, tokens[idx.clamp(max=L - 1)], torch.tensor(-1))


def drafted_states(draft: DFlashDraft, feats: torch.Tensor, tokens: torch.Tensor,
                   anchors: torch.Tensor) -> torch.Tensor:
    """[M, n, H]: `block_hidden` of the drafted slots only (all B anchor-first, else 1..B-1)."""
    return block_hidden(draft, feats, tokens, anchors)[:, 0 if draft.config.sample_from_anchor else 1:]


def position_weights(block_size: int, gamma: float, anchor_first: bool = False) -> torch.Tensor:
    k = torch.arange(1, block_size + anchor_first, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)  # [n]


def batch_loss(draft: DFlashDraft, b: Batch, weights: torch.Tensor, vocab: torch.Tensor | None,
               vocab_index: torch.Tensor | None, distill: float = 0.0,
               selector_weight: float = 1.0, dspark: tuple[float, float] = (0.9, 1.0)) -> torch.Tensor:
    """Weighted cross-entropy over the drafted slots (over `vocab` if given), mixed with
    KL(target || draft) at weight `distill` when the batch carries the target's hidden states;
    a DFlash 2 draft adds its selector's loss (`selector_loss`) at weight `selector_weight`; a DSpark
    draft's logits carry its Markov bias, and its loss is `dspark_loss` (weights: TV, confidence)."""
    y = drafted_states(draft, b.feats, b.tokens, b.anchors)  # [M, n, H]
    valid = b.targets >= 0
    targets = b.targets.clamp(min=0)
    head = draft.lm_head
    cols = None  # the target id of each logit column (None: all of them, in order)
    if vocab is None:
        logits = y @ head.T
    else:
        extra = torch.unique(targets[valid])
        extra = extra[vocab_index[extra] < 0]  # targets outside the fixed subset join this batch
        cols = torch.cat([vocab, extra])
        index = vocab_index.clone()
        index[extra] = torch.arange(len(vocab), len(cols))
        head = draft.lm_head[cols]
        logits = y @ head.T
        targets = torch.where(valid, index[targets], 0)  # masked positions weigh 0 anyway
    logits = draft.finish_logits(logits)
    if draft.markov_head is not None:
        logits = logits + markov_bias(draft, b, cols)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    t_logp = None
    if b.teacher is not None and (distill > 0 or draft.markov_head is not None):
        with torch.no_grad():
            t_logp = F.log_softmax((b.teacher @ head.T).float(), dim=-1)
    if distill > 0 and t_logp is not None:
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits.float(), dim=-1))).sum(-1)
        ce = (1 - distill) * ce + distill * kl.reshape(-1)
    w = (weights[None, :] * valid).reshape(-1)
    if draft.markov_head is not None:
        ce = dspark_loss(draft, ce, y, logits, targets, t_logp, b, dspark)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    if draft.candidate_selector is not None and selector_weight > 0:
        loss = loss + selector_weight * selector_loss(draft, y, logits, cols, b, weights)
    return loss


def slot_predecessors(b: Batch) -> torch.Tensor:
    """[M, n]: the true token before each drafted slot (the anchor, then the targets before it), the
    Markov head's `prev` when every earlier draft was right: the only case acceptance depends on."""
    n = b.targets.shape[1]
    return b.tokens[(b.anchors[:, None] + torch.arange(n)[None, :]).clamp(max=len(b.tokens) - 1)]


def markov_bias(draft: DFlashDraft, b: Batch, cols: torch.Tensor | None) -> torch.Tensor:
    """[M, n, C]: the Markov head's bias on each drafted slot, teacher-forced (`slot_predecessors`),
    over the logit columns `cols` (None: the whole vocabulary)."""
    head = draft.markov_head
    w2 = head.markov_w2.weight if cols is None else head.markov_w2.weight[cols]
    return head.markov_w1(slot_predecessors(b)) @ w2.T


def dspark_loss(draft: DFlashDraft, ce: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                t_logp: torch.Tensor | None, b: Batch, weights: tuple[float, float]) -> torch.Tensor:
    """DSpark's per-slot loss (the paper's eqs. 9-12), flat [M*n]: (1 - tv) x `ce` (the draft loss on the
    biased logits) + tv x TV(p_draft, p_target) + conf x BCE(confidence, 1 - TV), TV = 1/2 |p_d - p_t|_1
    and 1 - TV the analytic acceptance of the slot's token. p_target: the target's distribution (with a
    teacher, `--distill`), else its greedy token (one-hot: TV = 1 - p_d(token))."""
    tv_weight, conf_weight = weights
    p_d = F.softmax(logits.float(), dim=-1)
    if t_logp is not None:
        tv = 0.5 * (p_d - t_logp.exp()).abs().sum(-1)
    else:
        tv = 1.0 - p_d.gather(-1, targets[..., None]).squeeze(-1)
    loss = (1 - tv_weight) * ce + tv_weight * tv.reshape(-1)
    if draft.confidence_head is not None and conf_weight > 0:
        rows = draft.markov_head.markov_w1(slot_predecessors(b))
        conf_logit = draft.confidence_head.proj(torch.cat([y, rows.to(y.dtype)], dim=-1)).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, (1.0 - tv).detach(), reduction="none")
        loss = loss + conf_weight * bce.reshape(-1)
    return loss


def selector_loss(draft: DFlashDraft, y: torch.Tensor, logits: torch.Tensor, cols: torch.Tensor | None,
                  b: Batch, weights: torch.Tensor) -> torch.Tensor:
    """The candidate selector's own loss, teacher-forced: at each draft slot, the cross-entropy of its
    scores over the slot's top-K candidates after the TRUE predecessor (the anchor for slot 1, the
    target's token before the slot otherwise), labelled with the true token where it is a candidate
    (slots whose true token is not among them carry no selector loss). The candidates and their unary
    logits are the draft's own, detached: this loss trains the codebooks and the gate, the draft
    loss the logits. y: [M, B-1, H] result_norm of the slots; logits: [M, B-1, C] after
    finish_logits, over target ids `cols` (None: the whole vocabulary); weights: [B-1]."""
    sel = draft.candidate_selector
    k = min(sel.top_k, logits.shape[-1])
    unary, index = logits.detach().float().topk(k, dim=-1)  # [M, B-1, K]
    candidates = index if cols is None else cols[index]
    n_slots = y.shape[1]
    before = (b.anchors[:, None] + torch.arange(n_slots)[None, :]).clamp(max=len(b.tokens) - 1)
    predecessors = b.tokens[before]  # [M, B-1]: the anchor, then the true tokens
    gate = sel.hidden_projection(y)  # [M, B-1, r]
    pred = (sel.predecessor_codebook[predecessors] * gate).float()  # [M, B-1, r]
    succ = sel.successor_codebook[candidates].float()  # [M, B-1, K, r]
    scores = unary + torch.einsum("msr,mskr->msk", pred, succ)
    hit = candidates == b.targets[..., None]  # [M, B-1, K]
    present = hit.any(-1) & (b.targets >= 0)
    ce = F.cross_entropy(scores.reshape(-1, k), hit.float().argmax(-1).reshape(-1), reduction="none")
    w = (weights[None, :] * present).reshape(-1)
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def greedy_accepted(draft: DFlashDraft, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    """[M]: how many of each block's greedy drafts (full vocabulary) match `targets` before the first miss."""
    y = drafted_states(draft, feats, tokens, anchors)
    accepted = torch.zeros(len(anchors), dtype=torch.long)
    alive = torch.arange(len(anchors))  # blocks whose drafts matched so far
    for k in range(y.shape[1]):  # position by position: the head runs only where it still matters
        logits = draft.finish_logits(y[alive, k] @ draft.lm_head.T)
        if draft.markov_head is not None:  # every earlier draft matched: the true token is the chain's prev
            logits = logits + draft.markov_head(tokens[(anchors[alive] + k).clamp(max=len(tokens) - 1)])
        pred = logits.argmax(-1)
        alive = alive[(pred == targets[alive, k]) & (targets[alive, k] >= 0)]
        if not len(alive):
            break
        accepted[alive] += 1
    return accepted


@torch.no_grad()
def replay_tau(draft: DFlashDraft, sequences, chunk: int = 64) -> tuple[float, int]:
    """tau of the speculative loop replayed on stored greedy target outputs: (tau, verify steps).

    The first block is anchored on the first response token (the prefill's), each next block right
    after the last accepted token plus the target's own, as real greedy decoding anchors them: the
    tokens it would produce are the stored response, so no target runs. Unlike a mean over random
    anchors (the held-out measure of stages 1 to 5), blocks start where the previous one failed.
    tau = response tokens after the first / verify steps, as the evaluation counts it.
    """
    B = draft.config.block_size
    steps = produced = 0
    for tokens, prompt_len, feats in sequences:
        L = len(tokens)
        if L - prompt_len < 2:
            continue
        tok = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        feats = torch.from_numpy(np.asarray(feats, dtype=np.float32))
        accepted = torch.zeros(L, dtype=torch.long)
        for anchors in torch.arange(prompt_len, L - 1).split(chunk):
            accepted[anchors] = greedy_accepted(draft, feats, tok, anchors,
                                                block_targets(tok, anchors, B, draft.config.sample_from_anchor))
        steps += len(replay_anchors(accepted.tolist(), prompt_len))
        produced += L - 1 - prompt_len  # a last step's tokens past the end are not produced
    return (produced / steps if steps else 0.0), steps


def replay_anchors(accepted: list[int], prompt_len: int) -> list[int]:
    """Where greedy decoding anchors its blocks, given the drafted tokens accepted at each anchor."""
    anchors, a = [], prompt_len
    while a < len(accepted) - 1:
        anchors.append(a)
        a += 1 + accepted[a]
    return anchors


# --------------------------------------------------------------------------- loop

def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). There, bf16 autocast made a
    training step 1.6x faster; on an AVX2-only CPU it is emulated and made one 10x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def frequent_tokens(sequences, n: int) -> torch.Tensor:
    counts = np.zeros(1, dtype=np.int64)
    for tokens, prompt_len, _ in sequences:
        resp = tokens[prompt_len:]
        if resp.size:
            counts = np.pad(counts, (0, max(0, int(resp.max()) + 1 - counts.size)))
            np.add.at(counts, resp, 1)
    order = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(order[counts[order] > 0]).astype(np.int64))


def draft_vocabulary(sequences, k: int, target_gguf) -> torch.Tensor:
    """`d2t` of a reduced draft vocabulary: the target's end-of-generation tokens (so the draft can
    propose the stop), then the k most frequent response tokens, ascending."""
    from dflash_llama import gguf_info
    from dflash_llama.converter.vocabulary import eog_tokens

    meta = gguf_info(target_gguf).metadata
    n_vocab = len(meta.get("tokenizer.ggml.tokens", ()))
    eog = eog_tokens(meta, n_vocab)
    if not len(eog) < k < n_vocab:
        raise ValueError(f"--draft-vocab {k}: expected {len(eog) + 1} to {n_vocab - 1} (the target has {n_vocab} "
                         f"tokens, {len(eog)} of them end-of-generation tokens the draft keeps)")
    sequences = list(sequences)
    top = set(frequent_tokens(sequences, k).tolist())
    if eog - top:  # room for the end-of-generation tokens the responses use less
        top = set(frequent_tokens(sequences, k - len(eog - top)).tolist())
    return torch.tensor(sorted(eog | top), dtype=torch.int64)


SHARD_BYTES = 20_000_000  # a checkpoint larger than this is sharded, every file under it


def save_checkpoint(draft: DFlashDraft, out: Path, extra_config: dict | None = None,
                    d2t: torch.Tensor | None = None) -> None:
    """The published HF format: config.json + model.safetensors (bf16), no `model.` prefix. A reduced
    vocabulary (`d2t`: the target ids the draft's head keeps, ascending) is stored as EAGLE-3 and
    DSpark checkpoints store it: int64 offsets (target id = i + d2t[i]) and `draft_vocab_size`.
    Over SHARD_BYTES (a DFlash 2 draft's codebooks span the whole vocabulary), the weights are
    sharded as transformers shards them: model-0000i-of-0000n.safetensors and
    model.safetensors.index.json."""
    out.mkdir(parents=True, exist_ok=True)
    config = draft.config.to_hf_config(torch_dtype="bfloat16")
    config.update(extra_config or {})
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    if d2t is not None:
        state[L.D2T] = (d2t.to(torch.int64) - torch.arange(len(d2t), dtype=torch.int64)).contiguous()
        config[L.DRAFT_VOCAB_SIZE] = len(d2t)
    _save_weights(state, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _save_weights(state: dict[str, torch.Tensor], out: Path) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in state.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if stale.name not in names and stale.exists():
            stale.unlink()
    for name, shard in zip(names, shards):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@dataclass
class TrainLog:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    heldout_tau: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0


def _load_init(draft: DFlashDraft, init: str | os.PathLike, t: TargetWeights) -> None:
    """Copy a checkpoint's weights into `draft`.

    A checkpoint with fewer layers grows: each extra layer starts as a copy of the checkpoint's last
    layer with its output projections (o_proj, down_proj) zeroed, so it adds nothing to the residual
    stream and the grown draft computes exactly what the checkpoint computed until training moves it.
    A DFlash 1 checkpoint into a DFlash 2 draft keeps the draft's identity convolutions and small
    random selector, into a DSpark draft its zero Markov bias (`init_draft`): its logits are the
    checkpoint's until training moves them (a DSpark draft: with the same block layout).
    """
    from dflash_llama.reference.checkpoint import load_draft

    start = load_draft(init, t.embed_tokens, t.lm_head)
    mine, theirs = draft.config, start.config
    if set(theirs.variant.heads) - set(mine.variant.heads):
        raise ValueError(f"--init {init}: it is a {theirs.variant.title} draft, this training's a "
                         f"{mine.variant.title} one (give --variant {theirs.variant.name})")
    keys = ["n_embd", "n_ff", "n_head", "n_head_kv", "block_size", "target_layer_ids"]
    if theirs.variant.has(L.CONV):
        keys += ["conv_kernel_size", "conv_group_size", "selector_rank"]
    if theirs.variant.has(L.MARKOV):
        keys += ["markov_rank", "sample_from_anchor"]
    for key in keys:
        if getattr(mine, key) != getattr(theirs, key):
            raise ValueError(f"--init {init}: its {key} is {getattr(theirs, key)}, this training's is "
                             f"{getattr(mine, key)}")
    if theirs.n_layer > mine.n_layer:
        raise ValueError(f"--init {init}: it has {theirs.n_layer} layers, this training's draft "
                         f"{mine.n_layer} (a draft can grow, not shrink)")
    last = start.layers[-1].state_dict()
    state = start.state_dict()
    for il in range(theirs.n_layer, mine.n_layer):
        for name, value in last.items():
            zero = name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"layers.{il}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    if theirs.variant is mine.variant:
        draft.load_state_dict(state)
        return
    mine_only = {k for k in draft.state_dict()
                 if k.split(".")[0] in ("candidate_selector", "markov_head", "confidence_head") or "_conv." in k}
    mine_only -= set(state)  # a DSpark checkpoint without a confidence head gives its Markov head
    draft.load_state_dict({**{k: v for k, v in draft.state_dict().items() if k in mine_only}, **state})


def load_sequences(data_dirs: list, cfg: TrainConfig) -> list:
    """Every sequence of the datasets, a prompt in two datasets once; their target layers must be cfg's."""
    from .data import iter_sequences

    sequences = []
    for data_dir in data_dirs:
        manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
        if list(manifest["layer_ids"]) != list(cfg.target_layer_ids):
            raise ValueError(f"{data_dir} holds features of target layers {manifest['layer_ids']}, "
                             f"not {cfg.target_layer_ids}: build it with the same --target-layer-ids "
                             f"(the default depends on --layers)")
        sequences += list(iter_sequences(data_dir))
    unique = {seq[0].tobytes(): seq for seq in sequences}  # a prompt in two datasets is one sequence
    return list(unique.values())


def subset_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Position of each token in the loss's vocabulary subset, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def lr_schedule(opt, warmup_fraction: float, total_steps: int):
    """Linear warmup, then cosine decay to 0 at total_steps."""
    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total_steps - warmup))))
        return min((s + 1) / warmup, cosine)

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def distill_teacher(cfg: TrainConfig, target_gguf, t: TargetWeights):
    """(the target's layers after its deepest tap, in PyTorch; that tap's slice of the features)."""
    from dflash_llama.reference.target_tail import TargetTail

    deepest = max(cfg.target_layer_ids)
    tail = TargetTail(target_gguf, deepest + 1, t.lm_head)
    i = list(cfg.target_layer_ids).index(deepest)
    return tail, slice(i * t.embed_tokens.shape[1], (i + 1) * t.embed_tokens.shape[1])


def train(data_dirs: str | os.PathLike | list, target_gguf: str | os.PathLike, out_dir: str | os.PathLike,
          cfg: TrainConfig, progress: bool = True, threads: int = 0,
          init: str | os.PathLike | None = None) -> TrainLog:
    """Train (or resume) a draft on datasets built by train_data.build_dataset (one or several).

    init: an HF draft checkpoint to start from instead of random weights (fine-tuning); its shape
    and target layers must match `cfg`, except that it may have fewer layers (see _load_init).
    """
    from tqdm import tqdm

    if threads:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_dirs = [data_dirs] if isinstance(data_dirs, (str, os.PathLike)) else list(data_dirs)
    sequences = load_sequences(data_dirs, cfg)
    t = target_weights_from_gguf(target_gguf)
    rng = random.Random(cfg.seed)
    order = list(range(len(sequences)))
    rng.shuffle(order)
    heldout_ids, train_ids = order[:cfg.heldout], order[cfg.heldout:]
    if not train_ids:
        raise ValueError(f"{data_dirs} hold {len(sequences)} sequences: not enough to train")

    draft = init_draft(draft_config(cfg, t), cfg.seed)
    if init is not None:
        _load_init(draft, init, t)
    draft.attach_target(t.embed_tokens, t.lm_head)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    vocab = frequent_tokens((sequences[i] for i in train_ids), cfg.vocab_subset) if cfg.vocab_subset else None
    d2t = None
    if cfg.draft_vocab:  # the draft's own vocabulary, and the loss's: its rows are all it can propose
        d2t = vocab = draft_vocabulary((sequences[i] for i in train_ids), cfg.draft_vocab, target_gguf)
        if len(d2t) < cfg.draft_vocab:
            print(f"--draft-vocab {cfg.draft_vocab}: the training responses use {len(d2t):,} distinct tokens "
                  f"(end-of-generation ones included); the draft keeps those {len(d2t):,}", file=sys.stderr)
    vocab_index = None if vocab is None else subset_index(vocab, draft.config.n_vocab)

    params = [p for p in draft.parameters() if p.requires_grad]
    heads = [p for m in (draft.markov_head, draft.confidence_head) if m is not None for p in m.parameters()]
    backbone = [p for p in params if all(p is not h for h in heads)]
    groups = [{"params": backbone}] + ([{"params": heads, "lr": cfg.lr * cfg.head_lr_scale}] if heads else [])
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    total_steps = int(cfg.epochs * len(train_ids) / cfg.batch)  # 0: just write the (init) weights
    sched = lr_schedule(opt, cfg.warmup, total_steps)

    state_path = out / "train_state.pt"
    step, log = 0, TrainLog()
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, log = state["step"], TrainLog(**state["log"])
        rng.setstate(state["rng"])

    weights = position_weights(cfg.block_size, cfg.resolved_gamma(), cfg.sample_from_anchor)
    bf16 = cpu_has_bf16() if cfg.bf16 is None else cfg.bf16
    tail, tap = distill_teacher(cfg, target_gguf, t) if cfg.distill > 0 else (None, None)
    heldout = [sequences[i] for i in heldout_ids]
    t0 = time.time() - log.wall_s
    bar = tqdm(total=total_steps, initial=step, disable=not progress, desc="train", unit="step")
    last_tau = log.heldout_tau[-1][1] if log.heldout_tau else float("nan")
    draft.train()
    while step < total_steps:
        opt.zero_grad()
        loss_sum = 0.0
        for _ in range(cfg.batch):
            b = make_batch(*sequences[rng.choice(train_ids)], cfg.block_size, cfg.anchors, rng,
                           cfg.sample_from_anchor)
            if b is None:
                continue
            if tail is not None:
                attach_teacher(b, tail, tap)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = batch_loss(draft, b, weights, vocab, vocab_index, cfg.distill, cfg.selector_weight,
                                  (cfg.tv_weight, cfg.confidence_weight)) / cfg.batch
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        sched.step()
        step += 1
        log.steps.append(step)
        log.loss.append(loss_sum)
        if step % cfg.eval_every == 0 or step == total_steps:
            draft.eval()
            last_tau = replay_tau(draft, heldout)[0]
            draft.train()
            log.heldout_tau.append((step, last_tau))
            log.wall_s = time.time() - t0
            save_checkpoint(draft, out, d2t=d2t)
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "log": asdict(log), "rng": rng.getstate(), "config": asdict(cfg)},
                       state_path)
        bar.set_postfix(loss=f"{loss_sum:.3f}", heldout_tau=f"{last_tau:.3f}")
        bar.update(1)
    bar.close()
    if total_steps == 0:
        save_checkpoint(draft, out, d2t=d2t)
    log.wall_s = time.time() - t0
    return log
