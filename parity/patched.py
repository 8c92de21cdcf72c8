"""A patched copy of the pinned llama.cpp, to show a finding's divergence gone (patches/*.patch).

The pinned tree under third_party/llama.cpp is never modified: it is copied, the patch applied to
the copy, the files the patch touches compiled with the exact commands of our build
(compile_commands.json, paths moved to the copy) and linked with the build's other objects and
libraries into a patched `llama-speculative-simple`. Only touched translation units compile, so a
patch to common/ or src/ costs about a minute, not a full build. Headers the patch touches are
seen by the touched files only (enough for the patches shipped here).

    python -m dflash_llama.parity.patched patches/u5-dflash-full-block.patch     # builds, then shows U5
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflash_llama import toolbuild

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"


def touched_files(patch: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)]


def patched_tool(patch, work: str | Path, tool: str = "llama-speculative-simple") -> Path:
    """Build `tool` from a copy of the pinned tree with `patch` (one path or several) applied;
    returns the executable."""
    patches = [Path(p).resolve() for p in (patch if isinstance(patch, (list, tuple)) else [patch])]
    work = Path(work)
    pinned = (ROOT / "third_party" / "llama.cpp").resolve()
    build = toolbuild.build_dir()
    copy = work / "llama.cpp"
    files = []
    for patch in patches:
        touched = touched_files(patch)
        if not touched:
            raise ValueError(f"{patch}: no '+++ b/<file>' lines: not a unified diff against the llama.cpp tree")
        files += [f for f in touched if f not in files]
    for patch in patches:  # fail before copying 176 MB
        r = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "--batch", "-d", str(pinned), "-i", str(patch)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to the pinned tree:\n{r.stdout}{r.stderr}")
    if copy.exists():
        shutil.rmtree(copy)
    top_skip = {".git", "models", "build"}  # the root's model files and build folders, if any
    shutil.copytree(pinned, copy, ignore=lambda d, names: [n for n in names if Path(d) == pinned and n in top_skip])
    for patch in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(copy), "-i", str(patch)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to the pinned tree:\n{r.stdout}{r.stderr}")

    commands = toolbuild.compile_commands(build)
    objects = []
    for rel in files:
        if not rel.endswith((".c", ".cpp")):
            continue
        entry, source = toolbuild.compile_entry(commands, pinned / rel, copy, pinned, work)
        obj = work / "obj" / (rel.replace("/", "_") + ".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        toolbuild.compile_object(toolbuild.object_command(entry, source, obj, tree=(pinned, copy)), entry,
                                 f"patched {rel}")
        objects.append(str(obj))
    return toolbuild.link_tool(build, tool, objects, work / tool, f"patched {tool}")


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


def _tools(exe_patched: Path):
    from dflash_llama import paths

    return (("pinned", paths.tool("llama-speculative-simple")), ("patched", exe_patched))


def show_u5(exe_patched: Path) -> dict:
    """U5 before and after: drafts at --spec-draft-n-max 3 against the first 3 of the full block."""
    from .findings import PROMPT, tiny_fixture

    _, target, _, draft = tiny_fixture("u5", layers=2, target_layer_ids=[1, 2], block_size=8, seed=45)
    out = {}
    for name, exe in _tools(exe_patched):
        full = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 7)]
        short = [[t for t, _ in b] for b in draft_log(exe, target, draft, PROMPT, 3)]
        out[name] = {"n_max_7_first_3": full[0][:3], "n_max_3": short[0][:3],
                     "agree": [b[:3] for b in full[:len(short)]] == [b[:3] for b in short[:len(full)]]}
    out["fixed"] = out["patched"]["agree"] and not out["pinned"]["agree"]
    out["lines"] = [f"{n:8s} --spec-draft-n-max 7, first 3 drafts: {out[n]['n_max_7_first_3']}; --spec-draft-n-max 3: "
                    f"{out[n]['n_max_3']}; same drafts at every step: {out[n]['agree']}" for n in ("pinned", "patched")]
    return out


def show_u4(exe_patched: Path) -> dict:
    """U4 before and after: the top-candidate probabilities draft-dflash computes for the first block,
    against the published logits' (output_multiplier 0.25, soft-cap 2)."""
    from .findings import PROMPT, tiny_fixture, u4_probabilities

    p_raw, p_pub = u4_probabilities()
    _, target, _, draft = tiny_fixture("u4", layers=1, target_layer_ids=[1], block_size=8, seed=44,
                                extra_config={"output_multiplier": 0.25, "final_logit_softcapping": 2.0})
    out = {"published": round(float(p_pub.mean()), 3), "raw": round(float(p_raw.mean()), 3)}
    for name, exe in _tools(exe_patched):
        first = draft_log(exe, target, draft, PROMPT, 7)[0]
        out[name] = round(float(np.mean([p for _, p in first])), 3)
    out["fixed"] = abs(out["patched"] - out["published"]) < 5e-3 and abs(out["pinned"] - out["raw"]) < 5e-3
    out["lines"] = [f"mean top-candidate probability of the first block: published logits {out['published']}, "
                    f"raw logits {out['raw']}; pinned tool {out['pinned']}, patched tool {out['patched']}"]
    return out


SHOW = {"u4-dflash1-logit-scale.patch": ("U4", show_u4), "u5-dflash-full-block.patch": ("U5", show_u5)}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    argv = argv if argv is not None else sys.argv[1:]
    patch = Path(argv[0]) if argv else PATCHES / "u5-dflash-full-block.patch"
    if patch.name not in SHOW:
        print(f"no demonstration for {patch.name}; known: {', '.join(SHOW)}", file=sys.stderr)
        return 2
    finding, show = SHOW[patch.name]
    with tempfile.TemporaryDirectory(prefix="llama-patched-") as tmp:
        result = show(patched_tool(patch, tmp))
    print("\n".join(result["lines"]))
    print(f"{finding}: " + ("divergence gone with the patch" if result["fixed"] else "not shown"))
    return 0 if result["fixed"] else 1


if __name__ == "__main__":
    sys.exit(main())
