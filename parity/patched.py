"""A patched build of the pinned llama.cpp: the series in patches/ (patches/series, in order),
to show each finding's divergence gone where users run llama.cpp.

The pinned tree under third_party/llama.cpp is never modified. A patched tree is a copy of it
(hard links, so seconds; each file a patch touches is a real copy before the patch is applied),
cached under `$DFLASH_LLAMA_CACHE/patched/<key>/` by the patches' bytes and our build. Only the
translation units the patches touch compile, each with the exact command of our build
(compile_commands.json, paths moved to the copy), and their objects are cached by what they
compile, so changing one patch of the series recompiles only its files; the tools
(`llama-speculative-simple`, `llama-server`, and on request our extension module `_core`, for
`use_core`) are linked from them and the build's other objects, each object only into what links
its library. The build is laid out as a native folder (the module, `bin/`, `llama.cpp/`).
Headers a patch touches are seen by the touched files only (enough for the series shipped here).
The patched converter is the copy's own `convert_hf_to_gguf.py`.

    python -m dflash_llama.parity.patched       # the whole series: every finding before and after,
                                                # then every registry fixture pair exact through it
    python -m dflash_llama.parity.patched patches/u5-dflash-full-block.patch
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_llama import toolbuild

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
SERIES = PATCHES / "series"
TOOLS = ("llama-speculative-simple", "llama-server")
LAYOUT = "2"  # of a cached build: part of its key


def series(path: str | os.PathLike = SERIES) -> list[Path]:
    """The patches a series file names, in order (one file name per line, relative to the file;
    blank lines and `#` comments skipped, as quilt reads it)."""
    path = Path(path)
    names = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    patches = [path.parent / n for n in names if n]
    missing = [p.name for p in patches if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{path}: no such patch: {', '.join(missing)}")
    return patches


def touched_files(patch: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)]


@dataclass(frozen=True)
class Build:
    """One build of llama.cpp's tools: the pinned one (ours) or a patched one."""
    name: str  # "pinned" or "patched"
    tree: Path  # its llama.cpp tree (the converter, gguf-py)
    tools: dict[str, Path]
    patches: tuple[str, ...] = ()  # applied to the pinned tree, in order

    def tool(self, name: str) -> Path:
        if name not in self.tools:
            raise ValueError(f"the {self.name} build has no {name}; it has {', '.join(self.tools)}")
        return self.tools[name]

    @property
    def core(self) -> Path:
        """The build's extension module `dflash_llama._core` (our runtime on this llama.cpp)."""
        return self.tool(toolbuild.CORE)

    @property
    def converter(self) -> Path:
        return self.tree / "convert_hf_to_gguf.py"


def pinned_build() -> Build:
    from dflash_llama import paths

    return Build("pinned", paths.llama_cpp_dir(), {t: paths.tool(t) for t in TOOLS})


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def _patch(tree: Path, patch: Path) -> None:
    r = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(tree),
                        "-i", str(patch)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{patch.name} does not apply to the pinned tree:\n{r.stdout}{r.stderr}")


def _patched_tree(patches: list[Path], files: list[str], copy: Path) -> None:
    """`copy`: the pinned tree as hard links, each of `files` a real copy, `patches` applied in order."""
    pinned = toolbuild.PINNED.resolve()
    top_skip = {".git", "models", "build"}  # the root's model files and build folders, if any
    shutil.copytree(pinned, copy, copy_function=_link_or_copy, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == pinned and n in top_skip])
    for rel in files:  # never write through a link into the pinned tree
        target = copy / rel
        if target.exists():
            target.unlink()
            shutil.copy2(pinned / rel, target)
    for patch in patches:
        _patch(copy, patch)


def patched_build(patches: list[Path] | Path | None = None, tools: tuple[str, ...] = TOOLS,
                  cache: Path | None = None, log=print) -> Build:
    """The pinned tree with `patches` applied (default: patches/series), its tools built from it;
    cached, and incremental over the series (see the module's docstring)."""
    from dflash_llama.paths import cache_dir

    patches = series() if patches is None else [patches] if isinstance(patches, (str, Path)) else list(patches)
    patches = [Path(p).resolve() for p in patches]
    build = toolbuild.build_dir()
    for tool in tools:
        toolbuild.link_rule(build, tool)  # a tool our build does not make fails before anything is done
    files: list[str] = []
    for patch in patches:
        touched = touched_files(patch)
        if not touched:
            raise ValueError(f"{patch}: no '+++ b/<file>' lines: not a unified diff against the llama.cpp tree")
        files += [f for f in touched if f not in files]
    libs = sorted(build.glob("**/*.a"))  # llama.cpp's and ours (the extension module links both)
    key = _sha(LAYOUT, *(p.name + "\n" + p.read_text() for p in patches), *tools,
               *(f"{p}:{p.stat().st_mtime_ns}" for p in libs))
    root = (cache or cache_dir()) / "patched"
    work = root / key
    # laid out as a native folder (paths.native_dir): the module, bin/, llama.cpp/
    outputs = {t: work / (toolbuild.link_name(build, t) if t == toolbuild.CORE else f"bin/{t}") for t in tools}
    result = Build("patched", work / "llama.cpp", outputs, tuple(p.name for p in patches))
    if (work / "done").exists():
        return result

    if work.exists():
        shutil.rmtree(work)
    tmp = root / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _patched_tree(patches, files, tmp / "llama.cpp")
        objects = _objects(build, files, tmp / "llama.cpp", tmp, root / "objects", log)
        (tmp / "bin").mkdir()
        for tool in tools:
            log(f"linking patched {tool}")
            mine = [o for o, archive in objects if toolbuild.links(build, tool, archive)]
            toolbuild.link_tool(build, tool, mine, tmp / outputs[tool].relative_to(work), f"patched {tool}")
        if toolbuild.CORE in tools:  # the module finds its tools in bin/: the unpatched ones are the pinned
            from dflash_llama.paths import PEER_TOOLS

            for tool in PEER_TOOLS:
                if tool not in tools and (build / "bin" / tool).exists():
                    (tmp / "bin" / tool).symlink_to(build / "bin" / tool)
        (tmp / "done").write_text("\n".join(p.name for p in patches) + "\n")
        os.replace(tmp, work)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _objects(build: Path, files: list[str], copy: Path, work: Path, objects_dir: Path, log) -> list[tuple[str, str]]:
    """The objects of the translation units that compile the patched `files` (a file our build
    compiles inside a unity source: that unity source, once), each cached by its command and the
    patched sources it compiles, with the static library each replaces a member of."""
    pinned = toolbuild.PINNED.resolve()
    commands = toolbuild.compile_commands(build)
    headers = [rel for rel in files if not rel.endswith((".c", ".cpp", ".py"))]
    units: dict[str, tuple[dict, Path, list[str]]] = {}
    for rel in files:
        if not rel.endswith((".c", ".cpp")):
            continue
        entry, source = toolbuild.compile_entry(commands, pinned / rel, copy, pinned, work)
        units.setdefault(str(source), (entry, source, []))[2].append(rel)
    objects = []
    objects_dir.mkdir(parents=True, exist_ok=True)
    for entry, source, rels in units.values():
        args = toolbuild.object_command(entry, source, Path("OBJ"), tree=(pinned, copy))
        normal = [a.replace(str(copy), "<tree>").replace(str(work), "<work>") for a in args]
        key = _sha(*normal, *((copy / r).read_bytes() for r in sorted(rels + headers)))
        obj = objects_dir / f"{Path(rels[0]).name}.{key}.o"
        if not obj.exists():
            log(f"compiling patched {', '.join(rels)}")
            tmp = obj.with_name(f".{obj.name}.{os.getpid()}.tmp")
            args[args.index("OBJ")] = str(tmp)
            try:
                toolbuild.compile_object(args, entry, f"patched {', '.join(rels)}")
                os.replace(tmp, obj)
            finally:
                tmp.unlink(missing_ok=True)
        objects.append((str(obj), toolbuild.archive_of(build, entry)))
    return objects


def use_core(build: Build) -> None:
    """Make `build`'s extension module this process's `dflash_llama._core`, so that our runtime, the
    in-process llama.cpp graph and the tools it finds are that build's. Before any import of the
    pinned module: a process holds one."""
    import importlib.util

    import dflash_llama

    path = build.core
    loaded = sys.modules.get("dflash_llama._core")
    if loaded is not None:
        if Path(loaded.__file__).resolve() == path.resolve():
            return
        raise RuntimeError(f"dflash_llama._core is already loaded from {loaded.__file__}: the {build.name} "
                           "build's module must be loaded before anything uses the native module")
    spec = importlib.util.spec_from_file_location("dflash_llama._core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["dflash_llama._core"] = module
    dflash_llama._core = module


def patched_tool(patch, work: str | Path | None = None, tool: str = "llama-speculative-simple") -> Path:
    """`tool` built from the pinned tree with `patch` (one path or several) applied (`work`: unused,
    the build is cached)."""
    return patched_build(patch, tools=(tool,)).tool(tool)


_DRAFTED = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)\s+\(\s*([0-9.]+)\)")


def draft_log(exe: Path, target: Path, draft: Path, prompt: str, n_max: int,
              n_predict: int = 8) -> list[list[tuple[int, float]]]:
    """Per draft step, the top candidate (token, probability) at each block position, from the
    tool's debug log (-lv 5)."""
    from dflash_llama import peers

    from .native import FLASH_ATTN

    r = peers.run_tool(peers.speculative_command(target, prompt, n_predict, "draft-dflash", draft=draft, n_max=n_max,
                                                 threads=1, n_ctx=256, flash_attn=FLASH_ATTN, extra_args=["-lv", "5"],
                                                 exe=exe))
    if not r.ok:
        raise RuntimeError(f"{exe.name} failed: {r.log_tail()}")
    blocks: list[list[tuple[int, float]]] = []
    for pos, tok, p in _DRAFTED.findall(r.stdout + r.stderr):
        if int(pos) == 0:
            blocks.append([])
        blocks[-1].append((int(tok), float(p)))
    return blocks


def _builds(patched: Build) -> tuple[Build, Build]:
    return pinned_build(), patched


def _greedy_pair(exe: Path, target: Path, draft: Path, prompt: str | None = None, n_predict: int = 16,
                 n_max: int = 3) -> dict:
    """draft-dflash against the same tool drafting nothing, greedy, `-fa off`: exit status, and
    whether the texts are equal (token for token: one tokenizer, the texts compared whole)."""
    from dflash_llama import peers

    from .findings import PROMPT

    prompt = prompt or PROMPT
    runs = [peers.run_tool(peers.speculative_command(target, prompt, n_predict, "draft-dflash", draft=draft,
                                                     n_max=n, threads=1, n_ctx=1024, flash_attn="off", exe=exe))
            for n in (n_max, 0)]
    if not all(r.ok for r in runs):
        bad = next(r for r in runs if not r.ok)
        lines = [ln.strip() for ln in bad.stderr.splitlines() if "GGML_ASSERT" in ln or "error" in ln.lower()]
        return {"exit": bad.returncode, "exact": False, "error": (lines or [bad.log_tail()])[-1]}
    texts = [peers.parse_speculative(r.stdout, r.stderr, prompt, n_predict).text for r in runs]
    return {"exit": 0, "exact": bool(texts[0]) and texts[0] == texts[1]}


def _pair_lines(out: dict, what: str) -> list[str]:
    def one(r):
        return "exact (same text as drafting nothing)" if r["exact"] else (
            f"exit {r['exit']}: {r['error']}" if r["exit"] else "text differs from drafting nothing")
    return [f"{n:8s} {what}: {one(out[n])}" for n in ("pinned", "patched")]


def show_u1(patched: Build) -> dict:
    """U1 before and after: the converter on a draft whose config lists no target_layer_ids writes
    the published default taps, and llama-speculative-simple loads the file."""
    from dflash_llama import fixtures, gguf_info

    from .findings import tiny_fixture

    target_hf, target, hf, _ = tiny_fixture("u1", layers=2, block_size=8, seed=41)  # no target_layer_ids
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for build in _builds(patched):
            gguf = Path(tmp) / f"u1-{build.name}.gguf"
            fixtures.run_pinned_converter([str(hf), "--target-model-dir", str(target_hf), "--outfile", str(gguf),
                                           "--outtype", "f32"], script=build.converter)
            layers = gguf_info(gguf).metadata.get("dflash.target_layers")
            run = _greedy_pair(build.tool("llama-speculative-simple"), target, gguf)
            out[build.name] = {**run, "target_layers": [int(x) for x in layers] if layers is not None else None}
    out["fixed"] = (out["pinned"]["target_layers"] is None and out["pinned"]["exit"] != 0
                    and out["patched"]["exact"])
    out["lines"] = [f"{n:8s} converter wrote dflash.target_layers {out[n]['target_layers']}"
                    for n in ("pinned", "patched")]
    out["lines"] += _pair_lines(out, "llama-speculative-simple on the file")
    return out


def _first_drafts(build: Build, target: Path, draft: Path) -> dict:
    """The first block's greedy draft from the build's tool's log and from our runtime (features of
    the prompt minus its last token, the block opened by that token, as draft-dflash runs it)."""
    import dflash_llama

    from .findings import PROMPT
    from .graph import drafted_tokens

    rt = dflash_llama.Runtime(target, draft, n_threads=1, n_ctx=256, kv_f32=True, compact_draft_head=False)
    n = rt.block_size - 1
    tool = [t for t, _ in draft_log(build.tool("llama-speculative-simple"), target, draft, PROMPT, n)[0]]
    tokens = rt.tokenize(PROMPT)
    block = [tokens[-1]] + [rt.mask_token_id] * n
    ours = drafted_tokens(rt.trace_draft(rt.capture(tokens[:-1]), block), rt.n_vocab)[:n]
    return {"tool": tool, "runtime": ours}


def _show_capture(patched: Build, target: Path, draft: Path, what: str) -> dict:
    out = {b.name: _greedy_pair(b.tool("llama-speculative-simple"), target, draft) for b in _builds(patched)}
    out["drafts"] = _first_drafts(patched, target, draft) if out["patched"]["exit"] == 0 else None
    agree = out["drafts"] is not None and out["drafts"]["tool"] == out["drafts"]["runtime"]
    out["fixed"] = out["pinned"]["exit"] != 0 and out["patched"]["exact"] and agree
    out["lines"] = _pair_lines(out, what)
    if out["drafts"] is not None:
        out["lines"].append(f"patched  first block drafted {out['drafts']['tool']}; our runtime drafts "
                            f"{out['drafts']['runtime']}: {'same' if agree else 'DIFFERENT'}")
    return out


def show_u2(patched: Build) -> dict:
    """U2 before and after: a tap on the target's last layer (the registry's tiny-last-layer-tap pair):
    the patched tool runs, is exact, and drafts what our runtime (capturing `result_norm`) drafts."""
    from .findings import tiny_fixture

    _, target, _, draft = tiny_fixture("u2", layers=1, target_layer_ids=[3], block_size=4, seed=42)
    return _show_capture(patched, target, draft, "tap on target layer 3 of 4")


def show_u3(patched: Build) -> dict:
    """U3 before and after: a draft whose layer 1 is a sliding-window layer (window 4, block 8; the
    fixture of `findings U3`): the patched tool drafts what our runtime (and the reference) drafts."""
    from .findings import u3_fixture

    _, target, _, draft = u3_fixture()
    out = {b.name: {**_greedy_pair(b.tool("llama-speculative-simple"), target, draft),
                    **_first_drafts(b, target, draft)} for b in _builds(patched)}
    same = {n: out[n]["tool"] == out[n]["runtime"] for n in ("pinned", "patched")}
    out["fixed"] = not same["pinned"] and same["patched"] and out["patched"]["exact"]
    out["lines"] = [f"{n:8s} sliding layer 1: first block drafted {out[n]['tool']}; our runtime drafts "
                    f"{out[n]['runtime']}: {'same' if same[n] else 'DIFFERENT'}" for n in ("pinned", "patched")]
    out["lines"] += _pair_lines(out, "sliding-window draft")
    return out


def show_u7(patched: Build) -> dict:
    """U7 before and after: a DFlash draft on a gemma3 target (the registry's tiny-gemma3-f32 pair)."""
    from .findings import gemma3_fixture

    return _show_capture(patched, *gemma3_fixture(), "gemma3 target")


def show_u5(patched: Build) -> dict:
    """U5 before and after: drafts at --spec-draft-n-max 3 against the first 3 of the full block."""
    from .findings import PROMPT, tiny_fixture

    _, target, _, draft = tiny_fixture("u5", layers=2, target_layer_ids=[1, 2], block_size=8, seed=45)
    out = {}
    for build in _builds(patched):
        exe = build.tool("llama-speculative-simple")
        full = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 7)]
        short = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 3)]
        out[build.name] = {"n_max_7_first_3": full[0][:3], "n_max_3": short[0][:3],
                           "agree": [b[:3] for b in full[:len(short)]] == [b[:3] for b in short[:len(full)]]}
    out["fixed"] = out["patched"]["agree"] and not out["pinned"]["agree"]
    out["lines"] = [f"{n:8s} --spec-draft-n-max 7, first 3 drafts: {out[n]['n_max_7_first_3']}; --spec-draft-n-max 3: "
                    f"{out[n]['n_max_3']}; same drafts at every step: {out[n]['agree']}" for n in ("pinned", "patched")]
    return out


def show_u4(patched: Build) -> dict:
    """U4 before and after: the top-candidate probabilities draft-dflash computes for the first block,
    against the published logits' (output_multiplier 0.25, soft-cap 2)."""
    from .findings import PROMPT, tiny_fixture, u4_probabilities

    p_raw, p_pub = u4_probabilities()
    _, target, _, draft = tiny_fixture("u4", layers=1, target_layer_ids=[1], block_size=8, seed=44,
                                extra_config={"output_multiplier": 0.25, "final_logit_softcapping": 2.0})
    out = {"published": round(float(p_pub.mean()), 3), "raw": round(float(p_raw.mean()), 3)}
    for build in _builds(patched):
        first = draft_log(build.tool("llama-speculative-simple"), target, draft, PROMPT, 7)[0]
        out[build.name] = round(float(np.mean([p for _, p in first])), 3)
    out["fixed"] = abs(out["patched"] - out["published"]) < 5e-3 and abs(out["pinned"] - out["raw"]) < 5e-3
    out["lines"] = [f"mean top-candidate probability of the first block: published logits {out['published']}, "
                    f"raw logits {out['raw']}; pinned tool {out['pinned']}, patched tool {out['patched']}"]
    return out


def fixtures_exact(build: Build, n_prompts: int = 3, n_predict: int = 24) -> dict[str, dict]:
    """Every fixture pair of the registry (a tiny target of each family, the SWA draft, the last-layer
    tap) through `build`'s llama-speculative-simple, greedy, `-fa off`: DFlash at the draft's whole
    block against the same tool drafting nothing, on `n_prompts` HumanEval prompts. Pair name ->
    {family, exact (count), prompts, errors}."""
    from dflash_llama import gguf_info, prompts

    from . import registry

    pairs, defaults = registry.load()
    texts = [p.text for p in prompts.spread(prompts.load("humaneval"), n_prompts)]
    exe = build.tool("llama-speculative-simple")
    out = {}
    for pair in (p for p in pairs if p.kind == "fixture"):
        r = registry.resolve(pair, defaults)
        n_max = int(gguf_info(r.draft).get("dflash.block_size", 16)) - 1
        runs = [_greedy_pair(exe, r.target, r.draft, t, n_predict, n_max) for t in texts]
        out[pair.name] = {"family": pair.family, "exact": sum(x["exact"] for x in runs), "prompts": len(runs),
                          "errors": sorted({x["error"] for x in runs if x.get("error")})}
    return out


def _fixture_lines(build: Build, result: dict[str, dict]) -> list[str]:
    return [f"{build.name:8s} {name} ({r['family']}): DFlash == drafting nothing on {r['exact']}/{r['prompts']} "
            f"prompts (-fa off)" + (f"; {r['errors'][0]}" if r["errors"] else "") for name, r in result.items()]


# finding -> (its patch, the demonstration before and after)
SHOW = {"U1": ("u1-dflash-default-target-layers.patch", show_u1), "U2": ("u2-dflash-last-layer-tap.patch", show_u2),
        "U3": ("u3-dflash-causal-sliding-layers.patch", show_u3),
        "U4": ("u4-dflash1-logit-scale.patch", show_u4), "U5": ("u5-dflash-full-block.patch", show_u5),
        "U7": ("u7-gemma3-layer-inputs.patch", show_u7)}


def show(findings: list[str], patched: Build) -> int:
    """Print each finding before and after on `patched`; the number not shown fixed."""
    not_fixed = 0
    for finding in findings:
        result = SHOW[finding][1](patched)
        print("\n".join(result["lines"]))
        print(f"{finding}: " + ("reproduced on the pinned build, fixed on the patched build" if result["fixed"]
                                else "NOT shown fixed"))
        not_fixed += not result["fixed"]
    return not_fixed


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if not argv:  # the whole series
        patches = series()
        names = [p.name for p in patches]
        findings = [f for f, (patch, _) in SHOW.items() if patch in names]
    else:
        patches = [Path(a) for a in argv]
        by_patch = {patch: f for f, (patch, _) in SHOW.items()}
        unknown = [p.name for p in patches if p.name not in by_patch]
        if unknown:
            print(f"no demonstration for {', '.join(unknown)}; known: {', '.join(by_patch)}", file=sys.stderr)
            return 2
        findings = [by_patch[p.name] for p in patches]
    build = patched_build(patches)
    failed = show(findings, build)
    if not argv:  # the whole series: every fixture pair exact through the patched tool
        exact = fixtures_exact(build)
        print("\n".join(_fixture_lines(build, exact)))
        failed += sum(r["exact"] < r["prompts"] for r in exact.values())
    return failed


if __name__ == "__main__":
    sys.exit(main())
