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

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"


def build_dir() -> Path:
    """Our build that compiled the peer tools."""
    dirs = [p for p in sorted((ROOT / "build").glob("*/compile_commands.json"))
            if "speculative-simple" in (p.parent / "build.ninja").read_text(errors="replace")] \
        if (ROOT / "build").exists() else []
    if not dirs:
        raise FileNotFoundError("no build with compile_commands.json under build/: build the package first "
                                "(DFLASH_LLAMA_PEER_TOOLS=ON pip install --no-build-isolation -e .)")
    return dirs[0].parent


def touched_files(patch: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)]


def patched_tool(patch: str | Path, work: str | Path, tool: str = "llama-speculative-simple") -> Path:
    """Build `tool` from a copy of the pinned tree with `patch` applied; returns the executable."""
    patch, work = Path(patch).resolve(), Path(work)
    pinned = (ROOT / "third_party" / "llama.cpp").resolve()
    build = build_dir()
    copy = work / "llama.cpp"
    files = touched_files(patch)
    if not files:
        raise ValueError(f"{patch}: no '+++ b/<file>' lines: not a unified diff against the llama.cpp tree")
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(pinned, copy, ignore=shutil.ignore_patterns(".git", "build*", "models"))
    r = subprocess.run(["patch", "-p1", "--forward", "-d", str(copy), "-i", str(patch)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{patch.name} does not apply to the pinned tree:\n{r.stdout}{r.stderr}")

    commands = {Path(c["file"]).resolve(): c for c in json.loads((build / "compile_commands.json").read_text())}
    objects = []
    for rel in files:
        if not rel.endswith((".c", ".cpp")):
            continue
        entry = commands.get(pinned / rel)
        if entry is None:
            raise ValueError(f"{rel} is not compiled by our build: cannot patch it this way")
        obj = work / "obj" / (rel.replace("/", "_") + ".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        args = shlex.split(entry["command"].replace(str(pinned), str(copy)))
        args[args.index("-o") + 1] = str(obj)
        r = subprocess.run(args, cwd=entry["directory"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling patched {rel} failed:\n{r.stderr[-2000:]}")
        objects.append(str(obj))

    ninja = (build / "build.ninja").read_text()
    m = re.search(rf"^build bin/{re.escape(tool)}: CXX_EXECUTABLE_LINKER\S* (\S+\.o)[^\n]*\n((?:  [^\n]*\n)+)", ninja, re.M)
    if m is None:
        raise ValueError(f"{tool} is not built by our build (DFLASH_LLAMA_PEER_TOOLS=ON)")
    variables = dict(re.findall(r"^  (\w+) = (.*)$", m.group(2), re.M))
    libs = [str(build / x) if not x.startswith(("-", "/")) else x for x in variables["LINK_LIBRARIES"].split()]
    exe = work / tool
    # the patched objects come first: the archives' members defining the same symbols are not pulled
    cmd = ["g++", *variables.get("FLAGS", "").split(), str(build / m.group(1)), *objects, *libs, "-o", str(exe)]
    r = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"linking patched {tool} failed:\n{r.stderr[-2000:]}")
    return exe


_DRAFTED = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(-?\d+)")


def drafted_blocks(exe: Path, target: Path, draft: Path, prompt: str, n_max: int, n_predict: int = 8) -> list[list[int]]:
    """The top draft candidate at each block position, per draft step, from the tool's debug log."""
    r = subprocess.run([str(exe), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dflash",
                        "--spec-draft-n-max", str(n_max), "-p", prompt, "-n", str(n_predict), "--temp", "0",
                        "-c", "256", "-t", "1", "-lv", "5"], capture_output=True, text=True, errors="replace")
    if r.returncode != 0:
        raise RuntimeError(f"{exe.name} failed: {r.stderr.strip().splitlines()[-1:]}")
    blocks: list[list[int]] = []
    for pos, tok in _DRAFTED.findall(r.stdout + r.stderr):
        if int(pos) == 0:
            blocks.append([])
        blocks[-1].append(int(tok))
    return blocks


def show_u5(exe_patched: Path) -> dict:
    """U5 before and after: drafts at --spec-draft-n-max 3 against the first 3 of the full block."""
    from dflash_llama import paths

    from .findings import PROMPT, _tiny

    _, target, _, draft = _tiny("u5", layers=2, target_layer_ids=[1, 2], block_size=8, seed=45)
    out = {}
    for name, exe in (("pinned", paths.tool("llama-speculative-simple")), ("patched", exe_patched)):
        full = drafted_blocks(exe, target, draft, PROMPT, 7)
        short = drafted_blocks(exe, target, draft, PROMPT, 3)
        out[name] = {"n_max_7_first_3": full[0][:3], "n_max_3": short[0][:3],
                     "agree": [b[:3] for b in full[:len(short)]] == [b[:3] for b in short[:len(full)]]}
    return out


def main(argv: list[str] | None = None) -> int:
    import tempfile

    argv = argv if argv is not None else sys.argv[1:]
    patch = Path(argv[0]) if argv else PATCHES / "u5-dflash-full-block.patch"
    with tempfile.TemporaryDirectory(prefix="llama-patched-") as tmp:
        exe = patched_tool(patch, tmp)
        result = show_u5(exe)
    for name, r in result.items():
        print(f"{name:8s} --spec-draft-n-max 7, first 3 drafts: {r['n_max_7_first_3']}; --spec-draft-n-max 3: "
              f"{r['n_max_3']}; same drafts at every step: {r['agree']}")
    fixed = result["patched"]["agree"] and not result["pinned"]["agree"]
    print("U5: " + ("divergence gone with the patch" if fixed else "not shown"))
    return 0 if fixed else 1


if __name__ == "__main__":
    sys.exit(main())
