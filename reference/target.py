"""The target: a transformers causal LM (qwen3, llama, ...) with the features DFlash needs.

Loads an HF directory, or a GGUF through transformers' GGUF loader (dequantised to f32). One
forward gives logits and, when asked, the draft's context features: the concatenation over taps
of `hidden_states[id + 1]` (the output of target layer `id`). For `id == n_layers - 1` transformers
returns the FINAL-NORM output there, not the raw last layer output; the published reference reads
it that way, and so do we (llama.cpp's capture of "input of layer id+1" has no such layer).
The KV cache is a transformers DynamicCache, cropped back after each verify. A cache with
recurrent layers (Gated DeltaNet, Mamba) cannot be cropped: transformers' crop cuts their
convolution window only and leaves the recurrent state after the whole block. For such a cache
each forward keeps a copy of the state before it, and a crop restores that copy and runs the kept
tokens again, as the runtime's checkpoint rollback does.

Memory. `Target.load` builds the transformers model on the meta device and fills it from the file
through transformers' own conversion of that file (its GGUF tensor processors and weight
conversions, or the safetensors it would read), one group of tensors at a time, so the numbers are
those of `from_pretrained` bit for bit. A target whose weights fit in `KEEP_BELOW_BYTES` at the
reference dtype is filled whole at load (the model is then the one `from_pretrained` builds); a
larger one is layer-streamed: each decoder layer's weights are read and dequantised when the layer
runs and released after it, the output head stays resident (the draft multiplies by it too), and
the token embedding's rows are read as tokens first need them (`Target.embedding`). Peak memory
is then about one layer and the head at the reference dtype, plus activations.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

KEEP_BELOW_BYTES = 2 << 30  # a target whose weights take less at the reference dtype is loaded whole
DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n or logits_to_keep, V]
    features: torch.Tensor | None  # [n, n_taps * H]


class Target:
    def __init__(self, model, tokenizer=None, source: str = "", weights: StreamedWeights | None = None):
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self._tokenizer = tokenizer
        self.source = source
        self.weights = weights  # None: a model whose weights are all in memory
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu",
             streamed: bool | None = None, progress: bool = False) -> Target:
        """From an HF directory or a `.gguf` file, through transformers' conversion of it.

        streamed: None decides by size (layer-streamed above KEEP_BELOW_BYTES), True streams layers
        whatever the size, False loads whole; progress: a bar per forward over the layers while
        streaming."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"target {path} does not exist")
        check_device(device)
        try:
            weights = StreamedWeights.open(path, dtype, device, streamed, progress)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
            raise ValueError(f"cannot load target {path} with transformers: {e}") from e
        return cls(weights.model, source=str(path), weights=weights)

    @classmethod
    def load_whole(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Target:
        """transformers' `from_pretrained` on the whole file: every weight in memory at `dtype`
        (what `load` equals bit for bit)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"target {path} does not exist")
        try:
            if path.is_dir():
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=dtype, **_gguf_overrides(path))
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
            raise ValueError(f"cannot load target {path} with transformers: {e}") from e
        return cls(model.to(dtype), source=str(path))

    @property
    def streamed(self) -> bool:
        """Whether layers are read when they run and released after."""
        return self.weights is not None and not self.weights.keep

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def tokenizer(self):
        """The target's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = Path(self.source)
            self._tokenizer = (AutoTokenizer.from_pretrained(path) if path.is_dir() else
                               AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
        return self._tokenizer

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.shape[0]

    @property
    def embed_tokens(self) -> torch.Tensor:
        """[vocab, hidden], every row read (a streamed target reads them all here: see `embedding`)."""
        if self.weights is not None and self.weights.embedding is not None:
            self.weights.embedding.fill_all()
        return self.model.get_input_embeddings().weight

    @property
    def embedding(self) -> EmbeddingRows | None:
        """A streamed target's token embedding, rows read on demand (None: `embed_tokens` is whole)."""
        return None if self.weights is None else self.weights.embedding

    @torch.inference_mode()
    def embed(self, ids):
        """The embedding module's output for token ids (what layer 0 reads): NumPy float32 [n, H]."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).to(self.device)
        return self.model.get_input_embeddings()(ids)[0].float().cpu().numpy()

    @torch.inference_mode()
    def final_norm(self, hidden):
        """The output norm applied to hidden states [n, H] (what hidden_states reports for the last layer)."""
        norm = self.model.get_decoder().norm
        h = torch.as_tensor(hidden).to(self.device, norm.weight.dtype)
        return norm(h).float().cpu().numpy()

    @property
    def lm_head(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding table itself when tied."""
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"target {self.source}: an output head with a bias is not supported")
        return head.weight

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-generation ids from the generation config (else the model config)."""
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        for i in layer_ids:
            if not 0 <= i < self.n_layers:
                raise ValueError(f"target layer id {i} is out of range for a target with "
                                 f"{self.n_layers} layers (valid: 0..{self.n_layers - 1})")

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if hasattr(cache, "activate_past_recording"):  # sliding layers must stay croppable
            cache.activate_past_recording()
        return cache

    def crop(self, cache, length: int) -> None:
        """Drop every cached position >= length (for a recurrent cache: within the last forward)."""
        checkpoint = getattr(cache, "_before_last_forward", None)
        if checkpoint is None:
            cache.crop(length - cache.get_seq_length())
            return
        layers, start, ids = checkpoint
        if length == start + len(ids):
            return
        if not start <= length < start + len(ids):
            raise ValueError(f"a recurrent cache rolls back within its last forward (positions {start}.."
                             f"{start + len(ids) - 1}), not to {length}")
        cache.layers = layers
        cache._before_last_forward = None
        if length > start:
            self.forward(ids[:length - start], start, cache)

    @contextlib.contextmanager
    def rounding_as_ggml(self, gguf_types: dict[str, str], requantise: bool):
        """Within: every linear layer whose weight is a GGUF matrix rounds its input as ggml-cpu's
        matmul of that type does (to the type's vec_dot_type: q8_0, q8_1, q8_K, f16, bf16), and with
        `requantise` (the weights are not the GGUF's own: --target-hf) every such weight is rounded
        to its GGUF type as gguf-py quantises it. Yields a GgmlRounding saying what was covered."""
        rounding = GgmlRounding(self, gguf_types, requantise)
        try:
            yield rounding
        finally:
            rounding.remove()

    @staticmethod
    def _is_recurrent(cache) -> bool:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], start: int, cache,
                feature_layers: list[int] | None = None, logits_to_keep: int = 0,
                trace: dict | None = None, layer_inputs: dict | None = None) -> TargetOutput:
        """Run ids at positions start.. with the cache (which must hold exactly start tokens).

        feature_layers: target layer ids whose outputs make the draft features; trace: stores
        `target_feat-L` ([n, H], the output of target layer L) for each of them; layer_inputs:
        {layer id: [n, H]} hidden states that layer reads instead of the previous layer's output
        (each layer's own error, given another implementation's input: parity's local errors).
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).to(self.device)
        if cache.get_seq_length() != start:
            raise ValueError(f"the target cache holds {cache.get_seq_length()} tokens, "
                             f"not {start}")
        if self._is_recurrent(cache):
            cache._before_last_forward = (copy.deepcopy(cache.layers), start, ids[0].tolist())
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        want = bool(feature_layers)
        hooks = [self.model.get_decoder().layers[i].register_forward_pre_hook(_replace_input(h))
                 for i, h in (layer_inputs or {}).items()]
        try:
            with self.weights.pass_over(ids.shape[1]) if self.weights is not None else _nothing():
                out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                                 output_hidden_states=want, logits_to_keep=logits_to_keep,
                                 **{self._cache_arg: cache})
        finally:
            for h in hooks:
                h.remove()
        features = None
        if want:
            taps = [out.hidden_states[i + 1][0].cpu() for i in feature_layers]
            features = torch.cat(taps, dim=-1)
            if trace is not None:
                for i, t in zip(feature_layers, taps):
                    trace[f"target_feat-{i}"] = t
        return TargetOutput(out.logits[0].float().cpu(), features)


def _gguf_overrides(path: Path) -> dict:
    """Config values transformers' GGUF loader misses: it leaves qwen3's head_dim at its default
    (128) instead of reading `<arch>.attention.key_length`."""
    from dflash_llama import gguf_info

    key_length = gguf_info(path).get("attention.key_length")
    return {} if key_length is None else {"head_dim": int(key_length)}


def check_device(device: str) -> None:
    """ValueError unless the reference can run on `device` here."""
    if device not in DEVICES:
        raise ValueError(f"reference device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("reference device cuda: the installed torch sees no CUDA GPU")


def _replace_input(hidden: torch.Tensor):
    """A forward pre-hook giving a decoder layer `hidden` ([n, H]) as its input hidden states."""
    def hook(module, args):
        x = args[0]
        h = torch.as_tensor(hidden).to(x.device, x.dtype).reshape(x.shape)
        return (h, *args[1:])
    return hook


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- where the weights come from

class _GGUFSource:
    """A GGUF's tensors as transformers converts them: its tensor processors (legacy loader) or the
    file's raw blocks with the load-time conversions of its GGUF quantizer (Qwen3.5, LFM2, ...)."""

    EMBED = "token_embd.weight"
    LAYER = re.compile(r"^blk\.(\d+)\.")

    def __init__(self, path: Path, model, quantizer, dtype: torch.dtype):
        from dflash_llama import gguf_info

        self.path, self.model, self.quantizer, self.dtype = path, model, quantizer, dtype
        self.info = gguf_info(path)
        self.keys = [t.name for t in self.info.tensors]
        self.HEAD = "output.weight" if "output.weight" in self.keys else None  # None: tied to EMBED
        self._lazy = None
        if quantizer.supported:
            self._lazy = quantizer.get_state_dict(str(path), model)  # raw blocks, read when converted
        else:
            from transformers import modeling_gguf_pytorch_utils as G

            # the processors read the config's values (heads, experts), which the model's config holds
            processor = G.TENSOR_PROCESSORS.get(self.info.architecture, G.TensorProcessor)
            self._processor = processor(config=model.config.to_dict())
            self._names = G.get_gguf_hf_weights_map(model, self._processor)

    def nbytes(self, dtype: torch.dtype) -> int:
        import numpy as np

        return sum(int(np.prod(t.shape)) for t in self.info.tensors) * dtype.itemsize

    def state_dict(self, keys: list[str]) -> dict:
        if self._lazy is not None:
            return {k: self._lazy[k] for k in keys}
        return self._processed(keys, {k: self.info.read(k) for k in keys})

    def _processed(self, keys, arrays) -> dict:
        import numpy as np

        parsed = {"tensors": {}}
        for k in keys:
            r = self._processor.process(weights=arrays.pop(k), name=k, tensor_key_mapping=self._names,
                                        parsed_parameters=parsed)
            if r.name is not None and r.name in self._names:
                parsed["tensors"][self._names[r.name]] = torch.from_numpy(np.copy(r.weights)).to(self.dtype)
        return parsed["tensors"]

    def rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor, dequantised (blocks never span rows: the same values as whole)."""
        import numpy as np

        data = self.info.read(key, rows=ids.tolist())
        if self._lazy is None:
            data = self._processor.process(weights=data, name=key, tensor_key_mapping=self._names,
                                           parsed_parameters={"tensors": {}}).weights
        return torch.from_numpy(np.ascontiguousarray(data))


class _HFSource:
    """An HF directory's safetensors, read lazily (files opened per group, so nothing stays mapped)."""

    LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{path}: no *.safetensors files")
        self._file_of, self._shapes = {}, {}
        for f in self.files:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    self._file_of[k] = f
                    self._shapes[k] = h.get_slice(k).get_shape()
        self.keys = list(self._file_of)
        self.EMBED = next((k for k in self.keys if k.endswith("embed_tokens.weight")), None)
        self.HEAD = next((k for k in self.keys if k.endswith("lm_head.weight")), None)

    def nbytes(self, dtype: torch.dtype) -> int:
        import math

        return sum(math.prod(s) for s in self._shapes.values()) * dtype.itemsize

    def state_dict(self, keys: list[str]) -> dict:
        from safetensors import safe_open

        out = {}
        for f in {self._file_of[k] for k in keys}:
            with safe_open(f, framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in keys if self._file_of[k] == f})
        return out

    def rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file_of[key], framework="pt") as h:
            table = h.get_slice(key)
            return torch.cat([table[i:i + 1] for i in ids.tolist()]).float()


class _GGUFRows:
    """Rows of a GGUF's 2-D tensors, dequantised by gguf-py."""

    def __init__(self, info):
        self.info = info

    def rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.info.read(key, rows=ids.tolist()))


def gguf_vocab_tables(path: str | os.PathLike, lazy: bool, head_in_memory: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, EmbeddingRows | None]:
    """A GGUF target's token embedding and output head for a draft (its embedding of the block and
    its logits), dequantised to float32 by gguf-py: the head whole; the embedding whole too, or
    with `lazy` an unread table whose rows EmbeddingRows.fill reads (when the head is not tied to it).

    head_in_memory: a float32 head already held (a streamed reference target's), used instead of a
    second copy when it holds exactly the file's values (compared in chunks of rows: an 8B target's
    head is 2.5 GiB in float32)."""
    from dflash_llama import gguf_info

    info = gguf_info(path)
    names = {t.name for t in info.tensors}
    if "output.weight" not in names or not lazy:
        embed = torch.from_numpy(info.read("token_embd.weight"))
        head = torch.from_numpy(info.read("output.weight")) if "output.weight" in names else embed
        return embed, head, None
    if head_in_memory is not None and holds_rows_of(info, "output.weight", head_in_memory):
        head = head_in_memory
    else:
        head = torch.from_numpy(info.read("output.weight"))
    shape = (head.shape[0], info.tensor("token_embd.weight").shape[0])
    rows = EmbeddingRows(_GGUFRows(info), "token_embd.weight", shape, torch.float32, "cpu")
    return rows.table, head, rows


def holds_rows_of(info, key: str, table: torch.Tensor, chunk: int = 8192) -> bool:
    """Whether `table` (float32, on the CPU) equals the GGUF tensor `key` as gguf-py dequantises it,
    bit for bit; read `chunk` rows at a time."""
    n = table.shape[0] if table.dim() == 2 else -1
    if table.dtype != torch.float32 or table.device.type != "cpu" or list(info.tensor(key).shape)[::-1] != [
            n, table.shape[-1]]:
        return False
    for first in range(0, n, chunk):
        ids = list(range(first, min(first + chunk, n)))
        if not torch.equal(torch.from_numpy(info.read(key, rows=ids)), table[first:first + len(ids)]):
            return False
    return True


# ---------------------------------------------------------------- the model, filled by groups

class EmbeddingRows:
    """A streamed target's token embedding [vocab, hidden]: an unfilled table whose rows are read
    and dequantised when a token first needs them (untouched rows take no memory)."""

    def __init__(self, source, key: str, shape, dtype: torch.dtype, device: str):
        self.source, self.key = source, key
        self.table = torch.empty(shape, dtype=dtype, device=device)
        self.filled = torch.zeros(shape[0], dtype=torch.bool)
        self._transform = None

    def transform(self, fn) -> None:
        """Rows pass through `fn` when read (None: as the file holds them); rows read before are read again."""
        self._transform = fn
        self.filled[:] = False

    def fill(self, ids) -> None:
        """Read the rows of token ids `ids` not read yet."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.table.shape[0]):
            raise ValueError(f"token id out of range 0..{self.table.shape[0] - 1}")
        missing = torch.unique(ids)
        missing = missing[~self.filled[missing]]
        if missing.numel():
            rows = self.source.rows(self.key, missing)
            if self._transform is not None:
                rows = self._transform(rows)
            self.table[missing.to(self.table.device)] = rows.to(self.table.device, self.table.dtype)
            self.filled[missing] = True

    def fill_all(self, chunk: int = 1 << 14) -> None:
        for first in range(0, self.table.shape[0], chunk):
            self.fill(torch.arange(first, min(first + chunk, self.table.shape[0])))


class StreamedWeights:
    """A transformers causal LM built on the meta device and filled from its file by groups: the
    decoder layers one by one, the token embedding, the output head, the rest (norms, ...).

    keep: every group is filled once, at load (the model is the one `from_pretrained` builds);
    otherwise a layer is filled by a hook just before it runs and emptied again after it."""

    def __init__(self, model, source, load_config, device: str, keep: bool, progress: bool):
        self.model, self.source, self.load_config = model, source, load_config
        self.device, self.keep, self.progress = device, keep, progress
        self.layers = model.get_decoder().layers
        self.groups: dict = {}
        for k in source.keys:
            m = source.LAYER.search(k)
            group = int(m.group(1)) if m else "embed" if k == source.EMBED else "head" if k == source.HEAD else "rest"
            self.groups.setdefault(group, []).append(k)
        self.embedding: EmbeddingRows | None = None
        self.on_fill = None  # called with a streamed layer once its weights are in (GgmlRounding)
        self._bar = None
        self._fill(self.groups.get("rest", []), "the final norm and other tensors")
        tied = source.HEAD is None
        head_of = model.get_output_embeddings()
        embed_of = model.get_input_embeddings()
        if keep or tied:
            self._fill(self.groups.get("embed", []), "the token embedding")
        else:
            self.embedding = EmbeddingRows(source, source.EMBED, tuple(embed_of.weight.shape), load_config.dtype,
                                           device)
            embed_of.weight = torch.nn.Parameter(self.embedding.table, requires_grad=False)
            embed_of.register_forward_pre_hook(lambda _m, args, kwargs=None: self.embedding.fill(args[0]))
        if tied:
            head_of.weight = embed_of.weight
        else:
            self._fill(self.groups["head"], "the output head")
        if keep:
            for i in range(len(self.layers)):
                self._fill(self.groups.get(i, []), f"layer {i}", self.layers[i])
        else:
            for i, layer in enumerate(self.layers):
                layer.register_forward_pre_hook(self._before_layer(i))
                layer.register_forward_hook(self._after_layer(i))
            self._before_layer(0)(self.layers[0], ())  # a file transformers cannot convert fails here
            self._empty(self.layers[0])
        in_layers = {id(p) for p in self.layers.parameters()}
        lacking = [n for n, p in model.named_parameters() if p.device.type == "meta"
                   and (keep or id(p) not in in_layers)]
        if lacking:
            raise ValueError(f"the file has no weights for {', '.join(lacking[:4])}")

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype, device: str, streamed: bool | None, progress: bool):
        import transformers
        from transformers import AutoConfig
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        from transformers.quantizers.auto import get_hf_quantizer
        from transformers.utils import ContextManagers

        transformers.logging.disable_progress_bar()  # one "Loading weights" bar per group otherwise
        gguf = not path.is_dir()
        if gguf:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, **_gguf_overrides(path))
            quantizer, config, _ = get_hf_quantizer(config, None, None, True, {}, gguf_file=str(path))
            quantizer.read_header(str(path))
            dtype = quantizer.update_dtype(dtype)
        else:
            config, quantizer = AutoConfig.from_pretrained(path), None
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with ContextManagers(model_class.get_init_context(dtype, quantizer is not None, False, False)):
            model = model_class(config)
            if quantizer is not None:
                quantizer.preprocess_model(model=model, dtype=dtype, device_map=None,
                                           checkpoint_files=[str(path)], use_kernels=False)
        device_map = {"": torch.device(device)}
        load_config = LoadStateDictConfig(
            pretrained_model_name_or_path=str(path.parent if gguf else path), device_map=device_map, dtype=dtype,
            dtype_plan=model._get_dtype_plan(dtype), hf_quantizer=quantizer,
            weight_mapping=get_model_conversion_mapping(model, None, quantizer))
        # non-persistent buffers (RoPE frequencies, embedding scales) computed as from_pretrained does
        model._move_missing_keys_from_meta_to_device(set(), device_map, None, quantizer)
        model.initialize_weights()
        source = _GGUFSource(path, model, quantizer, dtype) if gguf else _HFSource(path)
        keep = source.nbytes(dtype) <= KEEP_BELOW_BYTES if streamed is None else not streamed
        return cls(model.eval(), source, load_config, device, keep, progress)

    def _fill(self, keys: list[str], what: str, module=None) -> None:
        """Convert and load `keys` into the model; every parameter of `module` must be filled."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        info, _ = convert_and_load_state_dict_in_model(self.model, self.source.state_dict(keys), self.load_config)
        problems = [f"{k}: {shape} in the file, {want} in the model" for k, shape, want in info.mismatched_keys]
        problems += [f"{k}: {e}" for k, e in info.conversion_errors.items()]
        if problems:
            raise ValueError(f"{what}: " + "; ".join(problems[:3]))
        if module is not None:
            lacking = [n for n, p in module.named_parameters() if p.device.type == "meta"]
            if lacking:
                raise ValueError(f"{what}: the file has no weights for {', '.join(lacking[:4])}")

    def _before_layer(self, i: int):
        def hook(module, args, kwargs=None):
            self._fill(self.groups.get(i, []), f"layer {i}", module)
            if self.on_fill is not None:
                self.on_fill(module)
        return hook

    def _after_layer(self, i: int):
        def hook(module, args, output):
            self._empty(module)
            if self._bar is not None:
                self._bar.update(1)
        return hook

    @staticmethod
    def _empty(module) -> None:
        """Release a layer's weights (back to the meta device: shapes only)."""
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    sub._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=False)

    def pass_over(self, n_tokens: int):
        """A context for one forward: a progress bar over the layers when streaming with progress on."""
        weights = self

        class _Pass:
            def __enter__(self):
                if weights.progress and not weights.keep:
                    from tqdm import tqdm

                    weights._bar = tqdm(total=len(weights.layers), desc=f"reference target ({n_tokens} tokens)",
                                        unit="layer", leave=False)

            def __exit__(self, *exc):
                if weights._bar is not None:
                    weights._bar.close()
                    weights._bar = None
                return False

        return _Pass()


# ---------------------------------------------------------------- ggml-cpu's roundings, emulated

# ggml-cpu's matmul converts its activations to the weight type's vec_dot_type first (type_traits_cpu
# in ggml-cpu.c); the weight types of a GGUF's matrices and theirs
VEC_DOT_TYPES = {"f32": None, "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0",
                 "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1", "q2_k": "q8_k", "q3_k": "q8_k",
                 "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k", "iq4_xs": "q8_k"}


def round_as_ggml(x: torch.Tensor, vec_dot_type: str | None) -> torch.Tensor:
    """`x` (rows along its last dimension) as ggml-cpu's x86 quantize_row_<vec_dot_type> stores it,
    dequantised: q8_0 / q8_1 blocks of 32 with d = amax / 127 kept as f16 and q = round(x * 127 / amax)
    (half to even), q8_K blocks of 256 with d = max / -127 kept as f32 (the element of largest
    magnitude, with its sign), f16 and bf16 rounded to nearest even."""
    if vec_dot_type is None:
        return x
    if vec_dot_type in ("f16", "bf16"):
        return x.to(torch.float16 if vec_dot_type == "f16" else torch.bfloat16).to(x.dtype)
    block = 256 if vec_dot_type == "q8_k" else 32
    if x.shape[-1] % block:
        return x
    shape, dtype = x.shape, x.dtype
    v = x.float().reshape(-1, block)
    amax = v.abs().amax(-1, keepdim=True)
    live = amax > 0
    if vec_dot_type == "q8_k":
        big = torch.gather(v, -1, v.abs().argmax(-1, keepdim=True))  # the first element of largest magnitude
        iscale = torch.where(live, -127.0 / big, torch.zeros_like(big))
        q = torch.clamp(torch.round(v * iscale), max=127)
        d = torch.where(live, 1.0 / iscale, torch.zeros_like(iscale))
    else:
        q = torch.round(v * torch.where(live, 127.0 / amax, torch.zeros_like(amax)))
        d = (amax / 127.0).half().float()
    return (q * d).reshape(shape).to(dtype)


def requantised(w: torch.Tensor, ggml_type: str) -> torch.Tensor | None:
    """`w` rounded to `ggml_type` as gguf-py quantises it (the values a GGUF of that type holds),
    None for a type gguf-py cannot quantise (the k-quants)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    if ggml_type.lower() == "f32":
        return w
    try:
        qtype = gguf.GGMLQuantizationType[ggml_type.upper()]
        data = np.ascontiguousarray(w.detach().float().cpu().numpy())
        back = dequantize(quantize(data, qtype), qtype).reshape(data.shape)
    except (KeyError, NotImplementedError, gguf.quants.QuantError):
        return None
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).to(w.device, w.dtype)


class GgmlRounding:
    """Hooks that make a Target's linear layers round as ggml-cpu's matmuls do (Target.rounding_as_ggml).

    covered: every GGUF matrix with a linear layer of this model is emulated exactly (its inputs
    rounded, its weights the GGUF's values); otherwise `uncovered` names what is not (fused
    experts, types gguf-py cannot quantise, architectures gguf-py cannot name)."""

    def __init__(self, target: Target, gguf_types: dict[str, str], requantise: bool):
        from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

        self.target, self.requantise = target, requantise
        self.uncovered: list[str] = []
        self._hooks, self._saved = [], {}
        try:
            names = get_gguf_hf_weights_map(target.model, TensorProcessor())
        except (NotImplementedError, ValueError) as e:
            names = {}
            self.uncovered.append(f"every matrix ({e.args[0].split('.')[0]})")
        self.types: dict[str, str] = {}  # parameter name -> GGUF type
        for gguf_name, ggml_type in gguf_types.items():
            ggml_type = ggml_type.lower()
            if VEC_DOT_TYPES.get(ggml_type, "?") is None:
                continue  # f32: nothing to round
            param = names.get(gguf_name)
            if param is None or not param.endswith(".weight"):
                if not gguf_name.endswith("norm.weight") and names:
                    self.uncovered.append(gguf_name)
                continue
            self.types[param] = ggml_type
        modules = dict(target.model.named_modules())
        for param, ggml_type in self.types.items():
            module = modules.get(param[:-len(".weight")])
            if ggml_type not in VEC_DOT_TYPES:
                self.uncovered.append(f"{param} ({ggml_type})")
            elif isinstance(module, torch.nn.Linear):
                self._hooks.append(module.register_forward_pre_hook(self._round_input(VEC_DOT_TYPES[ggml_type])))
        self.covered = not self.uncovered
        weights = target.weights
        if requantise:
            embedding = target.embedding
            for name, p in target.model.named_parameters(remove_duplicate=False):
                if name not in self.types or p.device.type == "meta":
                    continue
                if embedding is not None and p.data_ptr() == embedding.table.data_ptr():  # rows rounded when read
                    embedding.transform(lambda rows, t=self.types[name]: requantised(rows, t))
                else:
                    self._requantise(name, p, save=True)
            if weights is not None and not weights.keep:
                weights.on_fill = self._requantise_layer

    @staticmethod
    def _round_input(vec_dot_type: str):
        def hook(module, args):
            return (round_as_ggml(args[0], vec_dot_type), *args[1:])
        return hook

    def _requantise(self, name: str, p: torch.nn.Parameter, save: bool) -> None:
        new = requantised(p.data, self.types[name])
        if new is None:
            if name not in self.uncovered:
                self.uncovered.append(f"{name} ({self.types[name]}: gguf-py cannot quantise it)")
                self.covered = False
            return
        if save and id(p) not in self._saved:
            self._saved[id(p)] = (p, p.data)
        p.data = new

    def _requantise_layer(self, layer) -> None:
        prefix = {id(m): n for n, m in self.target.model.named_modules()}[id(layer)]
        for name, p in layer.named_parameters(prefix=prefix):
            if name in self.types:
                self._requantise(name, p, save=False)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for p, data in self._saved.values():
            p.data = data
        if self.target.weights is not None:
            self.target.weights.on_fill = None
        if self.requantise and self.target.embedding is not None:
            self.target.embedding.transform(None)
