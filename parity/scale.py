"""A parity run at a published pair's size, measured on this machine.

    python -m dflash_llama.parity.scale --shape qwen3-8b [--type q8_0] [-n 16 --limit 2 -t 2] \\
        [--prompt-tokens 64] [--out reports/scale/qwen3-8b-q8_0/] [--build-only] [-- PARITY_ARGS...]

Builds, deterministically and without a network:

- a target of a published model's shape (`SHAPES`: Qwen3 0.6B .. 8B) with random weights, written
  tensor by tensor straight to a GGUF of `--type` (q8_0 or q4_0, norms f32): no tensor larger than
  one row chunk ever exists in float32, so an 8B target builds in about a gigabyte. Its tokenizer is
  Qwen2/Qwen3's (151,936 tokens, the published vocabulary), read from the pinned llama.cpp tree's
  vocabulary-only GGUF (`models/ggml-vocab-qwen2.gguf`);
- a random draft of the published draft's shape (z-lab's Qwen3-*-DFlash-b16: 5 layers, block 16,
  taps 1, 9, 17, 25, 33, MASK 151669) as a Hugging Face checkpoint, converted by our converter;

then runs `dflash-llama parity` on the pair under `/usr/bin/time -v` and writes the parity report
with `scale.{json,md}` into `--out`: what was built and how long it took, the file sizes, every
stage's status, time and peak resident memory per phase, the whole run's peak against the budget
of 1.5 x the target GGUF + 4 GiB. Built files go to the cache folder (`$DFLASH_LLAMA_CACHE/scale`),
reused when their recipe is unchanged.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

QWEN2_VOCAB = Path("models") / "ggml-vocab-qwen2.gguf"  # in the pinned llama.cpp tree
VOCAB = 151936
MASK_TOKEN_ID = 151669  # z-lab's Qwen3 DFlash drafts
INIT_STD = 0.02  # Qwen3's initializer_range
ROW_CHUNK = 4096  # rows of a matrix drawn, quantised and dropped at a time
GIB = 1 << 30
BUDGET_MINUTES = 60


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool  # the output head is the token embedding (no output.weight)
    draft_layers: int = 5
    draft_taps: tuple[int, ...] = (1, 9, 17, 25, 33)
    block_size: int = 16

    @property
    def params(self) -> int:
        per_layer = (self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 3 * self.hidden * self.ffn
                     + 2 * self.hidden + 2 * self.head_dim)
        return VOCAB * self.hidden * (1 if self.tied else 2) + self.layers * per_layer + self.hidden


# the published configs (Qwen/Qwen3-*: config.json), and their z-lab DFlash-b16 drafts
SHAPES = {
    "qwen3-8b": Shape(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288, tied=False),
    "qwen3-4b": Shape(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, tied=True),
    "qwen3-1.7b": Shape(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, tied=True,
                        draft_taps=(1, 7, 13, 19, 25)),
    "qwen3-0.6b": Shape(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, tied=True,
                        draft_taps=(1, 7, 13, 19, 25)),
}
TYPES = ("q8_0", "q4_0")


# ---------------------------------------------------------------- the target, straight to GGUF

def target_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, NumPy shape) of every tensor of a qwen3 target, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (VOCAB, h))] + ([] if shape.tied else [("output.weight", (VOCAB, h))])
    out.append(("output_norm.weight", (h,)))
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, q)),
                (b + "attn_q_norm.weight", (shape.head_dim,)), (b + "attn_k_norm.weight", (shape.head_dim,)),
                (b + "ffn_norm.weight", (h,)), (b + "ffn_gate.weight", (shape.ffn, h)),
                (b + "ffn_up.weight", (shape.ffn, h)), (b + "ffn_down.weight", (h, shape.ffn))]
    return out


def _values(name: str, dims: tuple[int, ...], index: int, seed: int, qtype):
    """A tensor's data as the file holds it: norms' gains uniform in 0.5..1.5 (f32), matrices
    N(0, INIT_STD) quantised to `qtype`, drawn ROW_CHUNK rows at a time from the tensor's own stream."""
    from gguf.quants import quantize

    rng = np.random.default_rng([seed, index])
    if len(dims) == 1:
        return rng.uniform(0.5, 1.5, dims).astype(np.float32)
    rows, cols = dims
    first = quantize(rng.standard_normal((min(ROW_CHUNK, rows), cols), dtype=np.float32) * INIT_STD, qtype)
    out = np.empty((rows, first.shape[1]), dtype=np.uint8)
    out[:first.shape[0]] = first
    for r in range(first.shape[0], rows, ROW_CHUNK):
        n = min(ROW_CHUNK, rows - r)
        out[r:r + n] = quantize(rng.standard_normal((n, cols), dtype=np.float32) * INIT_STD, qtype)
    return out


def qwen2_vocab() -> Path:
    """The pinned llama.cpp tree's vocabulary-only Qwen2 GGUF (the installed copy of the tree holds
    only the converter: the source checkout's then)."""
    from dflash_llama import paths

    candidates = [paths.llama_cpp_dir() / QWEN2_VOCAB, Path(__file__).resolve().parents[1] / "third_party" /
                  "llama.cpp" / QWEN2_VOCAB]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"{QWEN2_VOCAB} is in neither {candidates[0].parents[1]} nor "
                            f"{candidates[1].parents[1]}: the scale run needs the pinned llama.cpp source tree "
                            "(python third_party/fetch_llama_cpp.py)")


def write_target(path: Path, shape: Shape, ggml_type: str, seed: int, log=print) -> Path:
    """A random qwen3 target of `shape` in `ggml_type`, with Qwen2/3's tokenizer."""
    import gguf

    vocab = qwen2_vocab()
    qtype = gguf.GGMLQuantizationType[ggml_type.upper()]
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen3")
    w.add_name(f"random qwen3, {shape.layers} layers, hidden {shape.hidden}, seed {seed}")
    w.add_block_count(shape.layers)
    w.add_context_length(40960)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[ggml_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, field in gguf.GGUFReader(str(vocab)).fields.items():
        if name.startswith("tokenizer."):
            value, vtype = field.contents(), field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, value, vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(name, value, vtype)
    tensors = target_tensors(shape)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    for name, dims in tensors:
        if len(dims) == 1:
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            row_bytes = dims[1] // block * type_size
            w.add_tensor_info(name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for index, (name, dims) in enumerate(tensors):
        w.write_tensor_data(_values(name, dims, index, seed, qtype))
        if index % 50 == 0:
            log(f"  {name} ({index + 1}/{len(tensors)}, {time.perf_counter() - t0:.0f} s)")
    w.close()
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- the draft

def write_draft(root: Path, target: Path, shape: Shape, outtype: str, seed: int) -> tuple[Path, Path]:
    """A random draft of z-lab's Qwen3 DFlash-b16 shape for `target`: (HF dir, GGUF by our converter)."""
    from dflash_llama import fixtures
    from dflash_llama.converter import convert

    config_dir = root / "target-config"  # what the draft builder reads of its target
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(
        {"hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "vocab_size": VOCAB}))
    hf = fixtures.tiny_draft_hf(root / "draft-hf", config_dir, fixtures.TinyDraftConfig(
        layers=shape.draft_layers, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        ffn=shape.ffn, block_size=shape.block_size, target_layer_ids=list(shape.draft_taps),
        mask_token_id=MASK_TOKEN_ID, rope_theta=1e6, init_std=INIT_STD, seed=seed))
    return hf, convert(hf, target, root / f"draft-{outtype}.gguf", outtype=outtype)


@dataclass(frozen=True)
class Recipe:
    shape: str
    type: str
    draft_type: str
    seed: int
    version: int = 1

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def build(recipe: Recipe, work: Path, log=print) -> dict:
    """The pair of `recipe` in `work` (reused when built by the same recipe): paths, sizes, build times."""
    shape = SHAPES[recipe.shape]
    work.mkdir(parents=True, exist_ok=True)
    marker = work / "recipe.json"
    target = work / f"target-{recipe.type}.gguf"
    draft = work / f"draft-{recipe.draft_type}.gguf"
    built = json.loads(marker.read_text()) if marker.is_file() else {}
    if built.get("recipe") == recipe.key() and target.is_file() and draft.is_file():
        log(f"reusing {work}")
        return built
    t0 = time.perf_counter()
    log(f"writing the target ({shape.params / 1e9:.2f} B parameters, {recipe.type}) to {target}")
    write_target(target, shape, recipe.type, recipe.seed, log)
    t1 = time.perf_counter()
    log("building the draft and converting it")
    draft_hf, draft = write_draft(work, target, shape, recipe.draft_type, recipe.seed + 1)
    t2 = time.perf_counter()
    built = {"recipe": recipe.key(), "target": str(target), "draft": str(draft), "draft_hf": str(draft_hf),
             "target_bytes": target.stat().st_size, "draft_bytes": draft.stat().st_size,
             "params": shape.params, "target_build_s": round(t1 - t0, 1), "draft_build_s": round(t2 - t1, 1)}
    marker.write_text(json.dumps(built, indent=1) + "\n")
    return built


# ---------------------------------------------------------------- the run

def _time_v(stderr: str) -> dict:
    """/usr/bin/time -v's peak resident set and wall time."""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", stderr)
    seconds = None
    if wall:
        parts = [float(x) for x in wall.group(1).split(":")]
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return {"peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None, "wall_s": seconds}


def run(built: dict, out: Path, args, extra: list[str]) -> dict:
    """`dflash-llama parity` on the built pair, timed; the scale record."""
    exe = Path(sys.executable).with_name("dflash-llama")
    cmd = ["/usr/bin/time", "-v", str(exe), "parity", "-m", built["target"], "-md", built["draft"],
           "--draft-hf", built["draft_hf"], "-n", str(args.n_predict), "--limit", str(args.limit),
           "--prompt-tokens", str(args.prompt_tokens), "-t", str(args.threads), "--out", str(out),
           "--name", out.name, *extra]
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (out / "parity.log").write_text(proc.stdout + "\n" + "\n".join(
        line for line in proc.stderr.splitlines() if "\r" not in line) + "\n")
    measured = _time_v(proc.stderr)
    report = json.loads((out / "parity.json").read_text()) if (out / "parity.json").is_file() else None
    budget = 1.5 * built["target_bytes"] + 4 * GIB
    return {"command": cmd[2:], "exit_status": proc.returncode, **measured,
            "budget_bytes": int(budget), "within_budget": measured["peak_rss_bytes"] is not None
            and measured["peak_rss_bytes"] <= budget,
            "within_time": measured["wall_s"] is not None and measured["wall_s"] <= BUDGET_MINUTES * 60,
            "passed": report["passed"] if report else None,
            "stages": {k: s["status"] for k, s in report["stages"].items()} if report else None,
            "resources": report.get("resources") if report else None}


def markdown(record: dict) -> str:
    b, r = record["built"], record["run"]
    shape = SHAPES[record["shape"]]
    gib = lambda x: "-" if x is None else f"{x / GIB:.2f} GiB"  # noqa: E731
    lines = [f"# Parity at scale: {record['shape']} ({record['type']})", "",
             f"Target: random qwen3, {shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} "
             f"heads, FFN {shape.ffn}, vocabulary {VOCAB}, {'tied' if shape.tied else 'untied'} head: "
             f"{b['params'] / 1e9:.2f} B parameters, GGUF {gib(b['target_bytes'])} "
             f"(built in {b['target_build_s']:.0f} s). Draft: {shape.draft_layers} layers, block {shape.block_size}, "
             f"taps {list(shape.draft_taps)}, GGUF {gib(b['draft_bytes'])} (built and converted in "
             f"{b['draft_build_s']:.0f} s).", "",
             f"Command: `dflash-llama {' '.join(r['command'][1:])}` on {record['machine']}.", "",
             f"Result: {'PASS' if r['passed'] else 'FAIL' if r['passed'] is False else 'no report'}"
             + (f" ({', '.join(f'{k} {v}' for k, v in r['stages'].items())})" if r["stages"] else ""), "",
             f"Whole run: {r['wall_s'] / 60:.1f} min (limit {BUDGET_MINUTES}), peak resident memory "
             f"{gib(r['peak_rss_bytes'])} (`/usr/bin/time -v`; budget 1.5 x GGUF + 4 GiB = {gib(r['budget_bytes'])}): "
             f"{'within' if r['within_budget'] else '**over**'} the memory budget, "
             f"{'within' if r['within_time'] else '**over**'} the time limit.", ""]
    res = r.get("resources")
    if res:
        lines += ["| phase | wall time | peak RSS | llama.cpp tools' peak RSS |", "|---|---|---|---|"]
        for p in res["phases"]:
            lines.append(f"| {p['phase']} | {p['seconds'] / 60:.1f} min | {gib(p['peak_rss_bytes'])} | "
                         f"{gib(p.get('children_peak_rss_bytes'))} |")
        lines.append("")
    lines += ["The parity report itself: [parity.md](parity.md).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_llama.parity.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", default="q8_0", choices=TYPES, help="the target's matrices (default q8_0)")
    p.add_argument("--draft-type", default="bf16", help="the draft GGUF's type (default bf16, as published)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, help="where the pair is built (default: the cache folder's scale/)")
    p.add_argument("--out", type=Path, help="report folder (default reports/scale/SHAPE-TYPE/)")
    p.add_argument("-n", "--n-predict", type=int, default=16)
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="prompt tokens kept per prompt (default 64: each prompt is decoded about a dozen times "
                        "by our runtime and llama.cpp, so on a CPU the prompts' length sets much of the time)")
    p.add_argument("--build-only", action="store_true")
    args, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    from dflash_llama import paths

    recipe = Recipe(args.shape, args.type, args.draft_type, args.seed)
    work = args.work or paths.cache_dir() / "scale" / f"{args.shape}-{args.type}"
    built = build(recipe, work)
    if args.build_only:
        print(json.dumps(built, indent=1))
        return 0
    out = args.out or Path("reports") / "scale" / f"{args.shape}-{args.type}"
    out.mkdir(parents=True, exist_ok=True)
    import os
    import platform

    record = {"shape": args.shape, "type": args.type, "built": built,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB",
              "run": run(built, out, args, extra)}
    record["built"] = {k: v for k, v in built.items() if k not in ("recipe",)}
    (out / "scale.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "scale.md").write_text(markdown(record))
    print((out / "scale.md").read_text())
    return 0 if record["run"]["passed"] and record["run"]["within_budget"] and record["run"]["within_time"] else 1


if __name__ == "__main__":
    sys.exit(main())
