"""The DFlash draft model (DFlash 1 and DFlash 2) in plain PyTorch (no transformers inside).

One forward takes the target features of context tokens the draft has not seen yet and a block
`[last accepted token, MASK, ..., MASK]`, and returns logits for block positions 1..B-1. The draft
owns `fc`, `hidden_norm`, its decoder layers and the final `norm`; token embeddings and the LM head
are the target's, handed in with `attach_target`. Weights are loaded by `checkpoint.load_draft`.

A DFlash 2 draft (`schema.DFLASH2`) adds two heads to that backbone. Each layer wraps attention
and the MLP in a grouped dynamic causal convolution (`attention_conv`, `mlp_conv`: the input side
on the normed input, the output side, with the same dynamic coefficients, on the sublayer's
output; its taps never leave the block, so the anchor has no predecessor and the injected context
never passes through it). And `propose` walks the `candidate_selector` from the anchor over the
top-K candidates of each draft slot, instead of taking each slot's argmax.

Everything is unbatched (one sequence): token-major tensors `[n_tokens, ...]`, as in ggml graphs.

Tracing: pass a dict as `trace` and every intermediate is stored under its name in the shared
vocabulary (llama.cpp's graph names in `src/models/dflash.cpp`, `-N` = layer N). Shapes, with
n = number of new context tokens, B = block length, H = hidden size, F = n_taps * H:

    fc_out              [n, H]        fc(ctx_feat), before hidden_norm
    inp_g_embeddings    [n, H]        hidden_norm(fc_out): the projected context
    Kcur_injected-N     [n, n_kv, D]  k_proj(context) after k_norm AND RoPE (context positions)
    Vcur_injected-N     [n, n_kv, D]  v_proj(context), no norm, no RoPE
    inp_noise_embd      [B, H]        target_embed(block) * input_embedding_scale
    noise_norm-N        [B, H]        input_layernorm (llama.cpp attn_norm) of the layer input
    Qcur-N              [B, n_head, D] q_proj(noise_norm) after q_norm AND RoPE (block positions)
    Kcur-N              [B, n_kv, D]  k_proj(noise_norm) after k_norm AND RoPE
    Vcur-N              [B, n_kv, D]  v_proj(noise_norm)
    ffn_inp-N           [B, H]        layer input + o_proj(attention)
    ffn_norm-N          [B, H]        post_attention_layernorm(ffn_inp)
    ffn_out-N           [B, H]        down(silu(gate(ffn_norm)) * up(ffn_norm)), before the residual
    l_out-N             [B, H]        ffn_inp + ffn_out: the layer output
    result_norm         [B, H]        final norm, every block position (position 0 included)
    result_output       [B, V]        lm_head(result_norm) for every block position, RAW: before
                                      output_multiplier and soft-capping, which llama.cpp applies in
                                      its sampler for DFlash 1 (the forward's return value has them)

A DFlash 2 draft adds, with G = H / conv_group_size groups, K_c = conv_kernel_size taps,
K = selector_top_k candidates, r = selector_rank and n = B - 1 draft slots (`propose` only for the
selector's):

    attn_conv_dyn-N     [B, 2*K_c*G]  attention_conv.kernel_projection(noise_norm): the dynamic taps,
                                      viewed [B, side, tap, group] (side 0 input, 1 output)
    attn_conv_in-N      [B, H]        the input side applied to noise_norm: what q, k and v read
                                      (Qcur, Kcur, Vcur then come from it, not from noise_norm)
    attn_conv_out-N     [B, H]        the output side applied to o_proj(attention), before the residual
    ffn_conv_dyn-N      [B, 2*K_c*G]  mlp_conv.kernel_projection(ffn_norm)
    ffn_conv_in-N       [B, H]        the input side applied to ffn_norm: what the MLP reads
    ffn_out-N           [B, H]        the MLP's output, before its output side
    ffn_conv_out-N      [B, H]        the output side applied to ffn_out, before the residual
    selector_unary      [n, K]        the candidates' logits (after output_multiplier and soft-capping)
    selector_candidates [n, K]        token ids: the top-K of each slot, by logit descending, ties by
                                      the smaller id
    selector_gate       [n, r]        hidden_projection(result_norm) of the draft slots
    selector_scores     [n, K, K]     score[slot, predecessor index, candidate index]; slot 1's only
                                      predecessor is the anchor: its row 0, repeated in every row
    selector_path       [n]           the walked tokens (the draft)

A DSpark draft (`schema.DSPARK`) adds a Markov head and, optionally, a confidence head, read by
`draft_chain`; its drafted slots are the whole block when it is anchor-first
(`DraftHParams.sample_from_anchor`: B inputs give B drafts, slot k predicting the token after
anchor + k), else slots 1..B-1 as DFlash's. With n = drafted slots:

    markov_prev         [n]           the token before each slot: the anchor, then the chain's drafts
    markov_bias         [n, V]        scale * markov_w2(markov_w1[markov_prev]): the bias on each slot's
                                      logits (a reduced vocabulary's: scattered through d2t, 0 elsewhere)
    biased_logits       [n, V]        the slot's logits (as DFlash's) + markov_bias: what it drafts from
    confidence          [n]           sigmoid(conf_proj . [result_norm ; markov_w1[markov_prev]] + b)

`fc_out` is named in llama.cpp's encoder graph only; its decoder graph names the normed tensor
`inp_g_embeddings`. A context batch and a block are separate llama.cpp graphs; here they are one
call. The untraced path pays one `is not None` test per name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dflash_llama.schema import (  # noqa: F401
    CONFIDENCE,
    CONV,
    MARKOV,
    SELECTOR,
    DraftHParams,
    default_target_layer_ids,
    rope_halves_order,
)

DraftConfig = DraftHParams  # the model's config is the one draft schema


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # statistics in f32 whatever the weights are
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [n, head_dim] for NeoX (rotate-half) RoPE, computed in f32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)) / linear_factor
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def interleaved_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows for interleaved-pair RoPE reordered for NeoX (rotate-half) RoPE
    (`schema.rope_halves_order`, the converter's permutation)."""
    return w[torch.as_tensor(rope_halves_order(w.shape[0], head_dim))]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; cos, sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DraftCache:
    """Per layer K (after k_norm and RoPE) and V of the projected context the draft has seen.

    Only context tokens enter the cache; block K/V are used once and dropped, which is what the
    published loop gets by cropping back to `start` after every draft forward.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [T, n_kv, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [T]

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        if length < 0 or length > len(self):
            raise ValueError(f"cannot crop a draft cache of {len(self)} tokens to {length}")
        if self.positions is None:
            return
        self.keys = [k[:length] for k in self.keys]
        self.values = [v[:length] for v in self.values]
        self.positions = self.positions[:length]


class GroupedDynamicConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution around one sublayer (`attention_conv`,
    `mlp_conv`). At block position i and channel c, side s (0: the sublayer's input, 1: its output):

        out[i, c] = sum over taps t of (base_kernel[s, t, c] + dyn[i, s, t, c // group_size]) * y[i - t, c]

    with y[j] = 0 before the block start and `dyn = kernel_projection(u)` from the sublayer's normed
    input u, computed once and used by both sides. New, it is the identity (tap 0 is 1, the
    projection 0): a DFlash 1 layer.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.kernel_size, self.group_size = cfg.conv_kernel_size, cfg.conv_group_size
        base = torch.zeros(2, self.kernel_size, cfg.n_embd)  # [side, tap, channel]
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        groups = cfg.n_embd // self.group_size
        self.kernel_projection = nn.Linear(cfg.n_embd, 2 * self.kernel_size * groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def forward(self, y: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """y: [..., L, H], one block of L positions; dyn: [..., L, 2*K*G] (kernel_projection's
        output for the same positions) -> [..., L, H]."""
        *lead, length, hidden = y.shape
        k = self.kernel_size
        coeff = dyn.view(*lead, length, 2, k, hidden // self.group_size)[..., side, :, :]
        weight = self.base_kernel[side] + coeff.repeat_interleave(self.group_size, dim=-1)  # [..., L, K, H]
        out = weight[..., 0, :] * y
        for tap in range(1, min(k, length)):  # a tap reaching before the block start reads zeros
            shifted = F.pad(y[..., :length - tap, :], (0, 0, tap, 0))
            out = out + weight[..., tap, :] * shifted
        return out


class DraftLayer(nn.Module):
    """One decoder layer; attribute names follow the published checkpoint (`layers.N.*`)."""

    def __init__(self, cfg: DraftConfig, il: int):
        super().__init__()
        self.il = il
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.is_causal = cfg.layer_is_causal(il)
        self.window = cfg.layer_window(il)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        a.k_proj = nn.Linear(cfg.n_embd, cfg.n_head_kv * cfg.head_dim, bias=False)
        a.v_proj = nn.Linear(cfg.n_embd, cfg.n_head_kv * cfg.head_dim, bias=False)
        a.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        a.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        a.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)
        dflash2 = cfg.variant.has(CONV)
        self.attention_conv = GroupedDynamicConv(cfg) if dflash2 else None
        self.mlp_conv = GroupedDynamicConv(cfg) if dflash2 else None

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (k_norm + RoPE) and V of the projected context c: [n, H] -> [n, n_kv, D] each."""
        a = self.self_attn
        k = apply_rope(a.k_norm(a.k_proj(c).view(-1, self.n_kv, self.head_dim)), cos, sin)
        v = a.v_proj(c).view(-1, self.n_kv, self.head_dim)
        return k, v

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """[B, T] bool (True = visible), or None when every block query sees every key."""
        if not self.is_causal and self.window is None:
            return None
        qp, kp = q_pos[:, None], k_pos[None, :]
        visible = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
        if self.is_causal:
            visible &= kp <= qp
        if self.window is not None:
            visible &= qp - kp < self.window
            if not self.is_causal:
                visible &= kp - qp < self.window
        return visible

    def forward(self, x, ctx_k, ctx_v, ctx_pos, blk_pos, blk_cos, blk_sin, trace=None, attn_mask=None,
                block_len=None):
        """x: [B, H] block hidden states; ctx_k, ctx_v: [T, n_kv, D] all context K/V (cache + new).

        attn_mask: [B, T + B] bool (True = visible) replacing the layer's own rule; the trainer
        packs many blocks into one call and gives each its own view of the context.
        block_len: with packed blocks, the length of each: a DFlash 2 convolution runs per block and
        never reads across a block boundary (None: x is one block)."""
        il, a = self.il, self.self_attn

        def conv(module: GroupedDynamicConv, y: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
            if block_len is None:
                return module(y, dyn, side)
            blocks = module(y.view(-1, block_len, y.shape[-1]), dyn.view(-1, block_len, dyn.shape[-1]), side)
            return blocks.reshape(y.shape)

        def traced(name: str, t: torch.Tensor) -> torch.Tensor:  # t, kept as `name-il` when tracing
            if trace is not None:
                trace[f"{name}-{il}"] = t
            return t

        h = traced("noise_norm", self.input_layernorm(x))
        attn_dyn = None
        if self.attention_conv is not None:  # DFlash 2: q, k and v read the convolved block
            attn_dyn = traced("attn_conv_dyn", self.attention_conv.kernel_projection(h))
            h = traced("attn_conv_in", conv(self.attention_conv, h, attn_dyn, 0))
        q = traced("Qcur", apply_rope(a.q_norm(a.q_proj(h).view(-1, self.n_head, self.head_dim)), blk_cos, blk_sin))
        k = traced("Kcur", apply_rope(a.k_norm(a.k_proj(h).view(-1, self.n_kv, self.head_dim)), blk_cos, blk_sin))
        v = traced("Vcur", a.v_proj(h).view(-1, self.n_kv, self.head_dim))

        # block queries see every context key and every block key (non-causal unless configured)
        keys = torch.cat([ctx_k, k]).transpose(0, 1)  # [n_kv, T + B, D]
        values = torch.cat([ctx_v, v]).transpose(0, 1)
        rep = self.n_head // self.n_kv  # GQA: query head i reads kv head i // rep
        keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
        mask = attn_mask if attn_mask is not None else self.attention_mask(blk_pos, torch.cat([ctx_pos, blk_pos]))
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                              scale=self.head_dim ** -0.5)
        attn = a.o_proj(attn.transpose(0, 1).reshape(x.shape[0], -1))  # [B, n_head * D] -> [B, H]
        if attn_dyn is not None:
            attn = traced("attn_conv_out", conv(self.attention_conv, attn, attn_dyn, 1))

        x = traced("ffn_inp", x + attn)
        hn = traced("ffn_norm", self.post_attention_layernorm(x))
        ffn_dyn = None
        if self.mlp_conv is not None:  # DFlash 2: the MLP reads the convolved block
            ffn_dyn = traced("ffn_conv_dyn", self.mlp_conv.kernel_projection(hn))
            hn = traced("ffn_conv_in", conv(self.mlp_conv, hn, ffn_dyn, 0))
        f = traced("ffn_out", self.mlp.down_proj(F.silu(self.mlp.gate_proj(hn)) * self.mlp.up_proj(hn)))
        if ffn_dyn is not None:
            f = traced("ffn_conv_out", conv(self.mlp_conv, f, ffn_dyn, 1))
        return traced("l_out", x + f)


@dataclass
class Walk:
    """A DFlash 2 draft's proposal for draft slots 1..n: the walked tokens, each slot's candidates
    and, when sampled, the distribution over them that each token was drawn from."""

    tokens: torch.Tensor  # [n] the draft
    candidates: torch.Tensor  # [n, K] token ids
    q: torch.Tensor | None = None  # [n, K] sampled: each row sums to 1; greedy: None
    probs: torch.Tensor | None = None  # [n, V] q over the whole vocabulary, zero outside the candidates


class CandidateSelector(nn.Module):
    """DFlash 2's candidate selector: a left-to-right walk over the top-K candidates of each draft
    slot, from the anchor. Slot s scores its candidate k after predecessor p as

        unary_s[k] + sum over r of A[p, r] * gate_s[r] * B[cand_s[k], r]

    with A, B the predecessor and successor codebooks (rows: target token ids) and
    gate_s = hidden_projection(result_norm of slot s); its token is the argmax over k (greedy) or a
    draw from softmax(scores / temperature), and becomes the next slot's predecessor."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        # plain Parameters: the checkpoint's names carry no `.weight`
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.n_vocab, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.n_vocab, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.n_embd, cfg.selector_rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-K of each row of logits [n, V]: (values, ids) [n, K], by value descending and
        ties by the smaller id (deterministic, unlike `torch.topk(sorted=False)`)."""
        k = self.top_k
        values, ids = logits.topk(k, dim=-1)
        if bool(((logits >= values[:, -1:]).sum(-1) > k).any()):  # a tie across the K-th place
            values, ids = logits.sort(dim=-1, descending=True, stable=True)  # slow, but exact
            return values[:, :k], ids[:, :k]
        ids = ids.sort(dim=-1).values  # the top-K set is settled: order it
        values, order = logits.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
        return values, ids.gather(-1, order)

    def scores(self, gate: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               anchor: int) -> torch.Tensor:
        """Every slot's scores [n, K, K]: [slot, predecessor index, candidate index]; the
        predecessors of slot s are the candidates of slot s - 1, those of the first slot the anchor
        (the same row K times)."""
        predecessors = torch.cat([torch.full_like(candidates[:1], anchor), candidates[:-1]])
        pred = self.predecessor_codebook[predecessors] * gate[:, None, :]  # [n, K, r]
        succ = self.successor_codebook[candidates]  # [n, K, r]
        return unary[:, None, :] + pred @ succ.transpose(1, 2)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, trace: dict | None = None) -> Walk:
        """hidden: [n, H] post-norm states of the draft slots; logits: [n, V] their logits in the
        target's vocabulary (after output_multiplier and soft-capping; -inf outside a reduced
        vocabulary). temperature 0: greedy; else one draw per slot with `generator`."""
        unary, candidates = self.candidates(logits)
        gate = self.hidden_projection(hidden)
        scores = self.scores(gate, unary, candidates, anchor)
        path, q_rows, index = [], [], 0  # every row of the first slot is the anchor's
        for slot in range(scores.shape[0]):
            row = scores[slot, index]
            if temperature > 0:
                q_rows.append(torch.softmax(row.float() / temperature, dim=-1))
                index = int(torch.multinomial(q_rows[-1], 1, generator=generator))
            else:
                index = int(row.argmax())  # ties: the first, i.e. the higher unary
            path.append(int(candidates[slot, index]))
        tokens = torch.tensor(path, dtype=torch.long)
        if trace is not None:
            trace.update(selector_unary=unary, selector_candidates=candidates, selector_gate=gate,
                         selector_scores=scores, selector_path=tokens)
        if not q_rows:
            return Walk(tokens, candidates)
        q = torch.stack(q_rows)
        probs = q.new_zeros(q.shape[0], self.predecessor_codebook.shape[0]).scatter(-1, candidates, q)
        return Walk(tokens, candidates, q, probs)


@dataclass
class Chain:
    """A DSpark-family draft's proposal for its drafted slots: the tokens, drawn left to right from
    the Markov-biased logits, and what each was drawn from."""

    tokens: torch.Tensor  # [n] the draft
    prev: torch.Tensor  # [n] the token before each slot (the anchor, then the draft)
    logits: torch.Tensor  # [n, V] the biased logits (the unbiased ones without a Markov head)
    confidence: torch.Tensor | None = None  # [n] in (0, 1), with a confidence head
    probs: torch.Tensor | None = None  # [n, V] sampled: the distribution each token was drawn from


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a rank-R bias on a slot's logits from the token before it,
    scale * markov_w2(markov_w1[prev]) (W1 rows: target tokens; W2 rows: draft tokens, the whole
    vocabulary or a reduced one's rows; scale: a GGUF's optional `markov_w2.scale`, else none)."""

    def __init__(self, cfg: DraftConfig, n_rows: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.n_vocab, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, n_rows or cfg.n_vocab, bias=False)
        self.over_vocabulary = n_rows is None  # W2's rows: every target token, in id order
        self.scale: float | None = None

    def keep_rows(self, ids: torch.Tensor) -> None:
        """W2 over a reduced vocabulary: its rows of target tokens `ids`, taken from W2 over the whole
        vocabulary (as the converter's --draft-vocab takes them)."""
        w = self.markov_w2.weight
        self.markov_w2.weight = nn.Parameter(w.detach()[ids].clone(), requires_grad=w.requires_grad)
        self.markov_w2.out_features, self.over_vocabulary = len(ids), False

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] target token ids -> the bias [..., W2's rows]."""
        bias = self.markov_w2(self.markov_w1(prev))
        return bias if self.scale is None else bias * self.scale


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: each slot's chance that the target accepts its token,
    sigmoid(proj . [post-norm hidden ; markov_w1[prev]] + bias)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.n_embd + cfg.markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_row: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_row [..., R] -> [...]."""
        return torch.sigmoid(self.proj(torch.cat([hidden, prev_row.to(hidden.dtype)], dim=-1)).squeeze(-1))


def greedy_pick(logits: torch.Tensor) -> tuple[int, None]:
    """A chain's default pick: the argmax (ties: the smaller id), no distribution."""
    return int(logits.argmax()), None


class DFlashDraft(nn.Module):
    """fc + hidden_norm over the target features, decoder layers over the block, final norm."""

    def __init__(self, cfg: DraftConfig, n_vocab_draft: int | None = None):
        """n_vocab_draft: a reduced vocabulary's size, when a DSpark draft's W2 is over its rows
        already (a GGUF's, a checkpoint's with its d2t); `set_vocabulary` says which tokens."""
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.n_taps * cfg.n_embd, cfg.n_embd, bias=False)
        self.hidden_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, il) for il in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.variant.has(SELECTOR) else None
        self.markov_head = MarkovHead(cfg, n_vocab_draft) if MARKOV in cfg.heads else None
        self.confidence_head = ConfidenceHead(cfg) if CONFIDENCE in cfg.heads else None
        self._own = {"embed_tokens": False, "lm_head": False}  # the draft's own (a checkpoint's), kept
        self.embed_tokens: torch.Tensor | None = None  # the target's, [V, H]
        self.lm_head: torch.Tensor | None = None  # the target's, [V, H]; or the draft's own, [K, H]
        self.d2t: torch.Tensor | None = None  # a reduced vocabulary: the target id of each head row, [K]
        self._head_from_target = False  # its head: those rows of the target's (a checkpoint's d2t)

    # the config's, under the names the speculative loop reads
    block_size = property(lambda self: self.config.block_size)
    mask_token_id = property(lambda self: self.config.mask_token_id)
    target_layer_ids = property(lambda self: self.config.target_layer_ids)

    def set_vocabulary(self, d2t: torch.Tensor, head: torch.Tensor | None = None) -> None:
        """A reduced vocabulary: the draft's own head [K, hidden] over target tokens d2t [K]; its
        logits are scattered into the target's vocabulary, -inf elsewhere (the pinned graph's d2t).
        head None: those rows of the target's head, taken when it is attached (a checkpoint's d2t)."""
        cfg = self.config
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        if d2t.dim() != 1 or (head is not None and head.shape != (d2t.shape[0], cfg.n_embd)):
            raise ValueError(f"a reduced vocabulary needs d2t [K] and a head [K, {cfg.n_embd}], "
                             f"got {tuple(d2t.shape)} and {None if head is None else tuple(head.shape)}")
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= cfg.n_vocab
                            or d2t.unique().numel() != d2t.numel()):
            raise ValueError(f"d2t must hold distinct token ids below the vocabulary size {cfg.n_vocab}")
        markov = self.markov_head
        if markov is not None and not markov.over_vocabulary and markov.markov_w2.out_features != d2t.numel():
            raise ValueError(f"the Markov head's markov_w2 has {markov.markov_w2.out_features} rows, the reduced "
                             f"vocabulary {d2t.numel()} tokens")
        if cfg.selector_top_k > d2t.numel():
            raise ValueError(f"selector_top_k {cfg.selector_top_k} is larger than the draft vocabulary "
                             f"({d2t.numel()} tokens)")
        if markov is not None and markov.over_vocabulary:  # W2's rows of those tokens, as the head's
            markov.keep_rows(d2t)
        self._head_from_target = head is None
        if head is None and self.lm_head is not None and self.d2t is None:
            head = self.lm_head[d2t]  # the target's head is attached already
        self.d2t = d2t
        self.lm_head = None if head is None else head.to(self.fc.weight.dtype)

    def set_own(self, embed_tokens: torch.Tensor | None = None, lm_head: torch.Tensor | None = None) -> None:
        """The draft's own token embeddings / output head over the whole vocabulary ([V, H]), as a
        DeepSpec checkpoint or a GGUF's `output.weight` holds them: `attach_target` keeps them."""
        if self.d2t is not None and lm_head is not None:
            raise ValueError("a draft with a reduced vocabulary has its head over its own tokens already")
        for name, w in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if w is not None:
                self._check_vocabulary_matrix(f"own {name}", w)
                setattr(self, name, w.to(self.fc.weight.dtype))
                self._own[name] = True

    def _check_vocabulary_matrix(self, name: str, w: torch.Tensor, whose: str = "the draft's") -> None:
        """w: [vocab, hidden] as this draft's config says."""
        cfg = self.config
        if w.dim() != 2 or w.shape[1] != cfg.n_embd:
            raise ValueError(f"draft hidden size {cfg.n_embd} does not match {whose} "
                             f"{name} of shape {tuple(w.shape)}")
        if w.shape[0] != cfg.n_vocab:
            raise ValueError(f"draft vocab size {cfg.n_vocab} does not match {whose} "
                             f"{name} with {w.shape[0]} rows")

    def attach_target(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use the target's token embeddings and output head ([vocab, hidden] each); a draft with a
        reduced vocabulary keeps its own head, one with its own embeddings or head (`set_own`) those."""
        for name, w in (("token embeddings", embed_tokens), ("output head", lm_head)):
            self._check_vocabulary_matrix(name, w, "the target's")
        dtype = self.fc.weight.dtype
        if not self._own["embed_tokens"]:
            self.embed_tokens = embed_tokens.to(dtype)
        if self._own["lm_head"]:
            return
        if self.d2t is None:
            self.lm_head = lm_head.to(dtype)
        elif self._head_from_target:
            self.lm_head = lm_head[self.d2t].to(dtype)

    def new_cache(self) -> DraftCache:
        return DraftCache(self.config.n_layer)

    def forward(self, ctx_feat: torch.Tensor, block_ids: torch.Tensor | list[int], start: int,
                cache: DraftCache | None = None, trace: dict | None = None) -> torch.Tensor:
        """Logits [B-1, V] for block positions 1..B-1 (after output_multiplier and soft-cap).

        ctx_feat: [n, n_taps*H] target features of the context tokens at positions start-n ..
        start-1 that the cache does not hold yet (n may be 0); block_ids: B token ids at
        positions start .. start+B-1. With a cache, it must hold exactly positions 0..start-n-1,
        and afterwards holds 0..start-1.
        """
        return self.block_logits(self.block_states(ctx_feat, block_ids, start, cache, trace), trace)

    def propose(self, ctx_feat: torch.Tensor, block_ids: torch.Tensor | list[int], start: int,
                cache: DraftCache | None = None, *, temperature: float = 0.0,
                generator: torch.Generator | None = None, trace: dict | None = None) -> Walk:
        """A DFlash 2 draft's tokens for block positions 1..B-1: the candidate selector's walk from
        the anchor block_ids[0], after one forward (arguments as `forward`). temperature 0:
        greedy; else sampled with `generator`."""
        if self.candidate_selector is None:
            raise ValueError(f"a {self.config.variant.title} draft has no candidate selector: its "
                             "tokens come from its logits")
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        y = self.block_states(ctx_feat, block_ids, start, cache, trace)
        return self.candidate_selector.walk(y[1:], self.block_logits(y, trace), int(block_ids[0]),
                                            temperature, generator, trace)

    def draft_chain(self, ctx_feat: torch.Tensor, block_ids: torch.Tensor | list[int], start: int,
                    cache: DraftCache | None = None, *, pick=greedy_pick, trace: dict | None = None) -> Chain:
        """A DSpark-family draft's tokens after one forward (arguments as `forward`): its drafted
        slots (the whole block anchor-first, else 1..B-1) left to right, slot k from its logits plus
        the Markov bias of the token before it (the anchor for the first), which is the token slot
        k - 1 drafted. pick(logits [V]) -> (token, distribution [V] or None): greedy by default; the
        loop's sampler draws from the biased logits. A reduced vocabulary's bias, over its rows, is
        scattered to the target's vocabulary (0 elsewhere, where the logits are -inf): every token
        drafted is one of its d2t, and conditions the next slot by its target id."""
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        y = self.block_states(ctx_feat, block_ids, start, cache, trace)
        logits = self.block_logits(y, trace, first=0 if self.config.sample_from_anchor else 1)
        hidden = y[-logits.shape[0]:]
        prev, tokens, rows, probs, biases = int(block_ids[0]), [], [], [], []
        for k in range(logits.shape[0]):
            rows.append(prev)
            row = logits[k]
            if self.markov_head is not None:
                biases.append(self.to_vocabulary(self.markov_head(torch.tensor(prev)), 0.0))
                row = row + biases[-1]
            token, p = pick(row)
            tokens.append(token)
            probs.append(p)
            prev = token
        chain_prev = torch.tensor(rows, dtype=torch.long)
        bias = torch.stack(biases) if biases else None
        chain = Chain(torch.tensor(tokens, dtype=torch.long), chain_prev, logits if bias is None else logits + bias,
                      probs=None if probs[0] is None else torch.stack(probs))
        if self.confidence_head is not None:
            chain.confidence = self.confidence_head(hidden, self.markov_head.markov_w1(chain_prev))
        if trace is not None:
            trace.update(markov_prev=chain_prev, biased_logits=chain.logits)
            if bias is not None:
                trace["markov_bias"] = bias
            if chain.confidence is not None:
                trace["confidence"] = chain.confidence
        return chain

    def block_states(self, ctx_feat: torch.Tensor, block_ids: torch.Tensor | list[int], start: int,
                     cache: DraftCache | None = None, trace: dict | None = None) -> torch.Tensor:
        """`result_norm` [B, H]: the final norm of every block position (arguments as `forward`)."""
        cfg = self.config
        if self.embed_tokens is None:
            raise RuntimeError("attach_target(embed_tokens, lm_head) must be called first")
        block_ids = torch.as_tensor(block_ids, dtype=torch.long)
        dtype = self.fc.weight.dtype
        if ctx_feat.dim() != 2 or ctx_feat.shape[1] != cfg.n_taps * cfg.n_embd:
            raise ValueError(f"ctx_feat has shape {tuple(ctx_feat.shape)}, expected "
                             f"[n, {cfg.n_taps * cfg.n_embd}] ({cfg.n_taps} taps)")
        ctx_feat = ctx_feat.to(dtype)
        n, b = ctx_feat.shape[0], block_ids.shape[0]
        if cache is not None and len(cache) != start - n:
            raise ValueError(f"the draft cache holds {len(cache)} tokens but the context starts "
                             f"at position {start - n}")

        ctx_pos = torch.arange(start - n, start)
        blk_pos = torch.arange(start, start + b)
        rope = (cfg.head_dim, cfg.rope_freq_base, dtype, cfg.rope_linear_factor or 1.0)
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, *rope)
        blk_cos, blk_sin = rope_cos_sin(blk_pos, *rope)

        fc_out = self.fc(ctx_feat)
        c = self.hidden_norm(fc_out)  # the projected context, [n, H]
        x = F.embedding(block_ids, self.embed_tokens) * (1.0 if cfg.embedding_scale is None else cfg.embedding_scale)
        if trace is not None:
            trace["fc_out"], trace["inp_g_embeddings"], trace["inp_noise_embd"] = fc_out, c, x

        all_pos = ctx_pos if cache is None or cache.positions is None else torch.cat(
            [cache.positions, ctx_pos])
        for il, layer in enumerate(self.layers):
            k_new, v_new = layer.context_kv(c, ctx_cos, ctx_sin)
            if trace is not None:
                trace[f"Kcur_injected-{il}"], trace[f"Vcur_injected-{il}"] = k_new, v_new
            if cache is not None:
                if cache.keys[il] is not None:
                    k_new = torch.cat([cache.keys[il], k_new])
                    v_new = torch.cat([cache.values[il], v_new])
                cache.keys[il], cache.values[il] = k_new, v_new
            x = layer(x, k_new, v_new, all_pos, blk_pos, blk_cos, blk_sin, trace)
        if cache is not None:
            cache.positions = all_pos
        y = self.norm(x)
        if trace is not None:
            trace["result_norm"] = y
        return y

    def block_logits(self, y: torch.Tensor, trace: dict | None = None, first: int = 1) -> torch.Tensor:
        """Logits [B-first, V] of block positions first..B-1 (DFlash's: 1..B-1) from `result_norm` y [B, H]."""
        logits = F.linear(y[first:], self.lm_head)
        if trace is not None:  # the whole block, computed apart so tracing never changes logits
            trace["result_output"] = self.to_vocabulary(F.linear(y, self.lm_head))
        return self.to_vocabulary(self.finish_logits(logits))

    def to_vocabulary(self, logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Head rows -> the target's vocabulary: as they are, or scattered through d2t (`fill` elsewhere)."""
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.n_vocab), fill)
        full[..., self.d2t] = logits
        return full

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """output_multiplier, then tanh soft-cap: the published compute_logits."""
        cfg = self.config
        if cfg.logit_scale is not None:
            logits = logits * cfg.logit_scale
        cap = cfg.logit_softcap
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits
