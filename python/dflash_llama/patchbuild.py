"""A patched build of the pinned llama.cpp: the series in patches/ (patches/series, in order).

The pinned tree under third_party/llama.cpp is never modified. A patched tree is a copy of it
(hard links, so seconds; each file a patch touches is a real copy before the patch is applied),
cached under `$DFLASH_LLAMA_CACHE/patched/<key>/` by the patches' bytes and our build. Only the
translation units the patches touch compile, each with the exact command of our build
(compile_commands.json, paths moved to the copy), and their objects are cached by what they
compile, so changing one patch of the series recompiles only its files; the tools
(`llama-speculative-simple`, `llama-server`, and on request our extension module `_core`, for
`use_core`) are linked from them and the build's other objects, each object only into what links
its library (a tool's own source, such as an example's main file, only into that tool). The build
is laid out as a native folder (the module, `bin/`, `llama.cpp/`).
Headers a patch touches are seen by the touched files only (enough for the series shipped here).
The patched converter is the copy's own `convert_hf_to_gguf.py`. What each patch fixes, shown
before and after: `dflash_llama.parity.patched`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_llama import toolbuild

ROOT = toolbuild.ROOT
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

    @property
    def label(self) -> str:
        """"pinned", or "patched (PATCH, ...)"."""
        return f"patched ({', '.join(self.patches)})" if self.patches else self.name

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
            mine = [(o, holder) for o, holder in objects if toolbuild.links(build, tool, holder)]
            toolbuild.link_tool(build, tool, [o for o, _ in mine], tmp / outputs[tool].relative_to(work),
                                f"patched {tool}", replaces=tuple(h for _, h in mine if h.endswith(".o")))
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
    patched sources it compiles, with what of our build each replaces (toolbuild.archive_of: a member
    of a static library, or a tool's own object)."""
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
