"""A peer tool of our build relinked with a few translation units compiled otherwise.

Our build compiles the pinned llama.cpp once (CMake, `build/<tag>/`). Two variants of its tools
need only a few files compiled differently: a patched tree (patchbuild.py: the files a patch
touches, from a copy of the tree) and a stock build (`stock_tool`: ggml-cpu with llamafile's
sgemm, as llama.cpp builds it by default and as its users run it; our build leaves sgemm out
because a verify would then not compute the logits of one-token decoding). Each file is compiled
with the exact command of our build (compile_commands.json) and linked first, ahead of the build's
archives, so the archives' members defining the same symbols are not pulled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (tools are relinked from its build/)
PINNED = ROOT / "third_party" / "llama.cpp"


def build_dir() -> Path:
    """Our build that compiled the peer tools."""
    dirs = [p for p in sorted((ROOT / "build").glob("*/compile_commands.json"))
            if "speculative-simple" in (p.parent / "build.ninja").read_text(errors="replace")] \
        if (ROOT / "build").exists() else []
    if not dirs:
        raise FileNotFoundError("no build with compile_commands.json under build/: build the package first "
                                "(./setup.sh, or DFLASH_LLAMA_PEER_TOOLS=ON pip install --no-build-isolation -e .)")
    return dirs[0].parent


def compile_commands(build: Path) -> dict[Path, dict]:
    """compile_commands.json of `build`, by source file."""
    return {Path(c["file"]).resolve(): c for c in json.loads((build / "compile_commands.json").read_text())}


def compile_entry(commands: dict[Path, dict], path: Path, copy: Path, pinned: Path, work: Path) -> tuple[dict, Path]:
    """The compile command for `path` and the source to compile: the file itself (in `copy`, a copy
    of `pinned`), or, for a file our build compiles inside a CMake unity source, a copy of that unity
    source pointing at the copy."""
    entry = commands.get(path)
    if entry is not None:
        return entry, copy / path.relative_to(pinned)
    for file, e in commands.items():
        if "/Unity/" in str(file) and f'"{path}"' in file.read_text(errors="replace"):
            unity = work / "unity" / file.name
            unity.parent.mkdir(parents=True, exist_ok=True)
            unity.write_text(file.read_text().replace(str(pinned), str(copy)))
            return e, unity
    raise ValueError(f"{path.relative_to(pinned)} is not compiled by our build: cannot patch it this way")


def object_command(entry: dict, source: Path, obj: Path, *, tree: tuple[Path, Path] | None = None,
                   defines: tuple[str, ...] = ()) -> list[str]:
    """`entry`'s compiler command, compiling `source` into `obj` (`tree`: (old, new) root of the
    sources, for a copy of the tree), with `defines` (-D...) added."""
    command = entry["command"].replace(entry["file"], str(source))
    if tree is not None:
        command = command.replace(str(tree[0]), str(tree[1]))
    args = shlex.split(command)
    args[args.index("-o") + 1] = str(obj)
    return args[:1] + [f"-D{d}" for d in defines] + args[1:]


def compile_object(args: list[str], entry: dict, what: str) -> None:
    r = subprocess.run(args, cwd=entry["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {what} failed:\n{r.stderr[-2000:]}")


CORE = "_core"  # the Python extension module, linked like a tool (patchbuild.py links a patched one)


@functools.lru_cache(maxsize=4)
def _read_ninja(path: str, mtime_ns: int) -> str:
    return Path(path).read_text()


def _ninja(build: Path) -> str:
    """build.ninja of `build`, read once per version of the file (a patched build asks it often)."""
    path = build / "build.ninja"
    return _read_ninja(str(path), path.stat().st_mtime_ns)


def _link_variables(rule: re.Match) -> dict[str, str]:
    return dict(re.findall(r"^  (\w+) = (.*)$", rule.group(3), re.M))


def link_rule(build: Path, tool: str) -> re.Match:
    """The ninja rule that links `tool` (a tool, or CORE: the extension module) in `build`: its
    output, its own objects, then its variables."""
    ninja = _ninja(build)
    out = rf"{re.escape(tool)}\.cpython[^:\s]*\.so" if tool == CORE else rf"bin/{re.escape(tool)}"
    linker = r"(?:CXX_EXECUTABLE_LINKER|CXX_MODULE_LIBRARY_LINKER)\S*"
    rule = rf"^build ({out}): {linker} ((?:\S+\.o )*\S+\.o)[^\n]*\n((?:  [^\n]*\n)+)"
    m = re.search(rule, ninja, re.M)
    if m is None:
        raise ValueError(f"{tool} is not built by our build (DFLASH_LLAMA_PEER_TOOLS=ON)")
    return m


def archive_of(build: Path, entry: dict) -> str:
    """What of our build holds the object `entry` (a compile_commands.json entry) compiles, as a path
    relative to `build`: the static library it is a member of, or the object itself where a tool
    links it on its own (a tool's main source, e.g. examples/speculative-simple/speculative-simple.cpp)."""
    obj = os.path.relpath(entry["output"], entry["directory"]) if "output" in entry else None
    ninja = _ninja(build)
    m = obj and re.search(rf"^build (\S+\.a): \w*STATIC_LIBRARY_LINKER\S*[^\n]* {re.escape(obj)}(?=[ \n])", ninja, re.M)
    if m:
        return m.group(1)
    if obj and re.search(rf"^build \S+: CXX_\w*LINKER\S* (?:\S+\.o )*{re.escape(obj)}(?=[ \n])", ninja, re.M):
        return obj
    raise ValueError(f"{entry['file']}: its object is in no static library of our build and no tool's own objects")


def links(build: Path, tool: str, holder: str) -> bool:
    """Whether `tool` links `holder` (as archive_of names it: a static library, or one of its own objects)."""
    m = link_rule(build, tool)
    if holder.endswith(".o"):
        return holder in m.group(2).split()
    return holder in _link_variables(m)["LINK_LIBRARIES"].split()


def link_name(build: Path, tool: str) -> str:
    """The file name `tool` links to (the extension module's carries the Python ABI tag)."""
    return Path(link_rule(build, tool).group(1)).name


def link_tool(build: Path, tool: str, objects: list[str], exe: Path, what: str, replaces: tuple[str, ...] = ()) -> Path:
    """Link `tool` as our build links it, with `objects` ahead of the build's libraries, in place of
    its own objects `replaces` (paths relative to `build`, as archive_of names them)."""
    m = link_rule(build, tool)
    variables = _link_variables(m)
    libs = [str(build / x) if not x.startswith(("-", "/")) else x for x in variables["LINK_LIBRARIES"].split()]
    flags = variables.get("FLAGS", "").split() if tool != CORE else \
        ["-fPIC", *variables.get("LANGUAGE_COMPILE_FLAGS", "").split(), *variables.get("LINK_FLAGS", "").split()]
    own = [str(build / o) for o in m.group(2).split() if o not in replaces]
    cmd = ["g++", *flags, *own, *objects, *libs, "-o", str(exe)]
    r = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"linking {what} failed:\n{r.stderr[-2000:]}")
    return exe


# ggml-cpu as llama.cpp builds it by default (GGML_LLAMAFILE=ON): ggml-cpu.c calls llamafile_sgemm
# for batches of two rows and more, sgemm.cpp (compiled like the other C++ files of ggml-cpu) has it
_SGEMM = "GGML_USE_LLAMAFILE"
_CPU_C = "ggml/src/ggml-cpu/ggml-cpu.c"
# our build compiles a copy of it with the multi-column dot products' hook (cmake/ggml_cpu_cols.cmake);
# a stock build compiles the pinned file, with that copy's command
_CPU_C_OURS = "ggml-cpu-cols/ggml-cpu.c"
_SGEMM_CPP = "ggml/src/ggml-cpu/llamafile/sgemm.cpp"
_CPU_CPP_LIKE = "ggml/src/ggml-cpu/ops.cpp"


# llamafile's sgemm serves only matmuls of two rows or more ("only enable sgemm for prompt
# processing"): a one-token decode takes ggml's own kernels, a verify of several tokens sgemm's,
# which sum in another order. Without this guard both take sgemm.
_ONE_ROW_GUARD = """#if !defined(__MMA__)
    if (n < 2)
        return false;
#endif"""


def _sgemm_source(work: Path, one_row: bool) -> tuple[Path, list[str]]:
    """sgemm.cpp as pinned, or a copy in `work` without the guard (and the -I its includes need)."""
    pinned = PINNED.resolve() / _SGEMM_CPP
    if not one_row:
        return pinned, []
    text = pinned.read_text()
    if text.count(_ONE_ROW_GUARD) != 1:
        raise RuntimeError(f"{pinned}: the one-row guard of llamafile_sgemm is not where it was: "
                           "the stock variant with one-row sgemm needs updating for this llama.cpp")
    copy = work / "sgemm-one-row.cpp"
    copy.write_text(text.replace(_ONE_ROW_GUARD, "    // (one-row guard removed: every matmul sgemm serves)"))
    return copy, [f"-I{pinned.parent}"]


def stock_tool(tool: str = "llama-speculative-simple", cache: Path | None = None, *,
               one_row_sgemm: bool = False) -> Path:
    """`tool` as a stock build of the pin makes it: ours, with llamafile's sgemm in ggml-cpu (the
    only default our build changes). one_row_sgemm: sgemm also for one-row matmuls (decoding), so
    that a verify and a decode take the same kernels. Cached by the compile commands and the build's
    libraries, so a rebuild of ours makes a new one; about 10 s on 2 cores the first time."""
    from .paths import cache_dir

    build = build_dir()
    link_rule(build, tool)  # a tool our build does not make fails before anything is compiled
    commands = compile_commands(build)
    pinned = PINNED.resolve()
    c_entry = commands.get(pinned / _CPU_C) or commands[build.resolve() / _CPU_C_OURS]
    cpp_entry = commands[pinned / _CPU_CPP_LIKE]
    libs = sorted(build.glob("llama.cpp/**/*.a"))
    key = hashlib.sha256(json.dumps([c_entry["command"], cpp_entry["command"], tool, one_row_sgemm,
                                     [(str(p), p.stat().st_mtime_ns) for p in libs]]).encode()).hexdigest()[:12]
    work = (cache or cache_dir()) / "stock-tools" / key
    exe = work / tool
    if exe.exists():
        return exe
    work.mkdir(parents=True, exist_ok=True)
    sgemm, includes = _sgemm_source(work, one_row_sgemm)
    objects = []
    for source, entry, extra in ((pinned / _CPU_C, c_entry, []), (sgemm, cpp_entry, includes)):
        obj = work / (source.name + ".o")
        args = object_command(entry, source, obj, defines=(_SGEMM,))
        compile_object(args[:1] + extra + args[1:], entry, f"{source.name} with {_SGEMM}")
        objects.append(str(obj))
    tmp = work / f".{tool}.{os.getpid()}.tmp"
    try:  # the cache holds whole files only
        link_tool(build, tool, objects, tmp, f"stock {tool}")
        os.replace(tmp, exe)
    finally:
        tmp.unlink(missing_ok=True)
    return exe
