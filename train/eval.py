"""Evaluating a trained draft three ways, on held-out HumanEval prompts (greedy, block B):

1. our runtime: tau and acceptance rate, every output checked equal to autoregressive decoding;
2. the same checkpoint converted by the *pinned llama.cpp converter*, run by the pinned
   `llama-speculative-simple --spec-type draft-dflash`: its acceptance rate (n_accept / n_drafted);
3. the published `dflash` package: `DFlashDraftModel.from_pretrained` on the checkpoint and its
   `dflash_generate` on the PyTorch target (transformers, the GGUF dequantised to f32).

Acceptance rate = accepted drafted tokens / drafted tokens; tau = tokens produced per verify.
The tools decode the same prompts; (3) is slow on a CPU, so it may take a subset (`n_published`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class EngineScore:
    engine: str
    prompts: int
    tokens: int
    steps: int  # target verifies
    drafted: int
    accepted: int
    seconds: float
    exact: bool | None = None  # greedy output == target greedy output (our runtime)
    note: str = ""
    accepted_hist: list[int] = field(default_factory=list)  # [j]: verifies that accepted j drafted tokens

    def acceptance_by_position(self) -> list[float]:
        """[k-1]: the share of verifies whose drafted token k was accepted (k = 1..B-1)."""
        steps = sum(self.accepted_hist)
        return [sum(self.accepted_hist[k:]) / steps for k in range(1, len(self.accepted_hist))] if steps else []

    @property
    def tau(self) -> float:
        return (self.tokens - self.prompts) / self.steps if self.steps else 0.0  # the first token is the prefill's

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "tau": round(self.tau, 4), "acceptance_rate": round(self.acceptance_rate, 4)}


@dataclass
class DraftEvaluation:
    checkpoint: str
    target: str
    block_size: int
    n_predict: int
    scores: list[EngineScore] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"checkpoint": self.checkpoint, "target": self.target, "block_size": self.block_size,
                "n_predict": self.n_predict, "scores": [s.to_json() for s in self.scores]}

    def markdown(self) -> str:
        rows = ["| engine | prompts | tau | acceptance rate | exact | seconds | note |",
                "|---|---:|---:|---:|---|---:|---|"]
        for s in self.scores:
            exact = "" if s.exact is None else ("yes" if s.exact else "NO")
            tau = f"{s.tau:.3f}" if s.steps else "n/a"  # llama-speculative-simple reports no verify count
            rows.append(f"| {s.engine} | {s.prompts} | {tau} | {s.acceptance_rate:.3f} | {exact} | "
                        f"{s.seconds:.0f} | {s.note} |")
        return "\n".join(rows)


def humaneval_prompts() -> list[str]:
    from dflash_llama.prompts import humaneval

    return [p.text for p in humaneval()]


def score_runtime(target: Path, draft_gguf: Path, prompts: list[str], n_predict: int, block_size: int,
                  threads: int, progress: bool = True) -> EngineScore:
    from tqdm import tqdm

    from dflash_llama.runtime import Runtime

    rt = Runtime(target, draft_gguf, n_threads=threads, n_ctx=2048, compact_draft_head=False)  # as the peers
    s = EngineScore("dflash-llama runtime", 0, 0, 0, 0, 0, 0.0, exact=True, accepted_hist=[0] * block_size)
    t0 = time.perf_counter()
    for p in tqdm(prompts, desc="runtime", disable=not progress):
        g = rt.generate(p, n_predict, block_size=block_size, draft_max=None)  # tau of the whole block
        if g.tokens != rt.autoregressive(p, n_predict).tokens:
            s.exact = False
        s.prompts += 1
        s.tokens += len(g.tokens)
        s.steps += len(g.steps)
        s.drafted += sum(len(x.drafted) for x in g.steps)
        s.accepted += sum(x.accepted for x in g.steps)
        for x in g.steps:
            s.accepted_hist[min(x.accepted, block_size - 1)] += 1
    s.seconds = time.perf_counter() - t0
    return s


def score_native(target: Path, checkpoint: Path, prompts: list[str], n_predict: int, block_size: int,
                 threads: int, work: Path, progress: bool = True) -> EngineScore:
    """The checkpoint converted by the pinned converter (it needs the target's HF dir: we write one
    holding the config and tokenizer transformers reads from the GGUF), run by llama.cpp."""
    from tqdm import tqdm

    from dflash_llama import fixtures, peers

    hf = work / "target-hf"
    if not (hf / "config.json").exists():
        _target_hf_dir(target, hf)
    gguf = work / "draft-pinned-f16.gguf"
    if not gguf.exists():
        fixtures.run_pinned_converter([str(checkpoint), "--target-model-dir", str(hf), "--outfile", str(gguf),
                                       "--outtype", "f16"])
    s = EngineScore("llama.cpp draft-dflash (pinned converter)", 0, 0, 0, 0, 0, 0.0,
                    note=f"--spec-draft-n-max {block_size - 1}, -fa off")
    t0 = time.perf_counter()
    for p in tqdm(prompts, desc="llama.cpp", disable=not progress):
        r = peers.speculative(str(target), p, n_predict, "draft-dflash", threads=threads, n_ctx=2048,
                              draft=str(gguf), n_max=block_size - 1)
        s.prompts += 1
        s.drafted += r.n_drafted
        s.accepted += r.n_accept
        s.tokens += r.n_tokens
    s.steps = 0  # the tool does not report its verify count; the acceptance rate is what compares
    s.seconds = time.perf_counter() - t0
    return s


def _target_hf_dir(target: Path, out: Path) -> None:
    """What the pinned converter reads from a target HF dir, for a GGUF-only target: its tokenizer
    (as transformers reads it from the GGUF) and a config. The config names the qwen3 architecture
    whatever the target's: llama.cpp's llama vocab handler would read this tokenizer as
    SentencePiece, the qwen3 one reads it as the GGUF has it (gpt2 BPE, pre-tokenizer smollm)."""
    from transformers import AutoTokenizer

    from dflash_llama import gguf_info

    info = gguf_info(target)
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name).save_pretrained(out)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": info.get("embedding_length"), "num_hidden_layers": info.block_count,
        "num_attention_heads": info.get("attention.head_count"),
        "vocab_size": len(info.metadata["tokenizer.ggml.tokens"])}, indent=1))


def score_published(target: Path, checkpoint: Path, prompts: list[str], n_predict: int, block_size: int,
                    progress: bool = True) -> EngineScore:
    """`dflash==0.1.0` on the PyTorch target (transformers' GGUF loader, f32)."""
    import time as _time

    import dflash.model as published
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from dflash_llama.reference.target import Target

    target_model = Target.load(target).model
    tokenizer = AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name)
    draft = published.DFlashDraftModel.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    s = EngineScore("dflash==0.1.0 (PyTorch target, f32)", 0, 0, 0, 0, 0, 0.0,
                    note="drafted = verify size - 1 per verify")
    real_clock = published._cuda_time
    published._cuda_time = _time.perf_counter  # its statistics synchronise CUDA otherwise
    t0 = time.perf_counter()
    try:
        for p in tqdm(prompts, desc="dflash package", disable=not progress):
            ids = torch.tensor([tokenizer(p)["input_ids"]])
            r = published.dflash_generate(draft, target_model, ids, n_predict, [tokenizer.eos_token_id],
                                          block_size=block_size, return_stats=True)
            s.prompts += 1
            s.tokens += r.num_output_tokens
            s.steps += len(r.acceptance_lengths)
            start = ids.shape[1]
            for produced in r.acceptance_lengths:  # verify size as dflash_generate chooses it
                s.drafted += min(block_size, ids.shape[1] + n_predict - start) - 1
                s.accepted += produced - 1
                start += produced
    finally:
        published._cuda_time = real_clock
    s.seconds = time.perf_counter() - t0
    return s


def evaluate(checkpoint: Path, target: Path, out: Path, *, n_prompts: int = 164, n_published: int = 40,
             n_predict: int = 128, block_size: int = 8, threads: int = 0, engines=("runtime", "native", "published"),
             progress: bool = True) -> DraftEvaluation:
    from dflash_llama.converter.pair import resolve_draft

    prompts = humaneval_prompts()[:n_prompts]
    ev = DraftEvaluation(str(checkpoint), str(target), block_size, n_predict)
    work = out / "eval-work"
    work.mkdir(parents=True, exist_ok=True)
    if "runtime" in engines:
        ev.scores.append(score_runtime(target, resolve_draft(checkpoint, target, "f16"), prompts, n_predict,
                                       block_size, threads, progress))
    if "native" in engines:
        ev.scores.append(score_native(target, checkpoint, prompts, n_predict, block_size, threads, work, progress))
    if "published" in engines:
        sub = prompts[:n_published]
        if n_published < len(prompts):  # our runtime on the same subset, for a like-for-like ratio
            ev.scores.append(score_runtime(target, resolve_draft(checkpoint, target, "f16"), sub, n_predict,
                                           block_size, threads, progress))
            ev.scores[-1].engine += f" (first {n_published})"
        ev.scores.append(score_published(target, checkpoint, sub, n_predict, block_size, progress))
    _keep_other_engines(ev, out / "eval.json")
    (out / "eval.json").write_text(json.dumps(ev.to_json(), indent=1) + "\n")
    return ev


def _keep_other_engines(ev: DraftEvaluation, path: Path) -> None:
    """An evaluation of some engines keeps the earlier scores of the others (same settings): a score
    is replaced only by a new one of the same engine on the same prompts (its full label)."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    if (old.get("block_size"), old.get("n_predict")) != (ev.block_size, ev.n_predict):
        return
    names = {s.engine for s in ev.scores}
    fields = set(EngineScore.__dataclass_fields__)
    kept = [EngineScore(**{k: v for k, v in s.items() if k in fields}) for s in old["scores"]
            if s["engine"] not in names]
    ev.scores[:0] = kept


def write_comparison(drafts: dict[str, Path], out: Path, engine: str = "dflash-llama runtime") -> Path:
    """Several evaluated drafts side by side: OUT/README.md (their `engine` scores) and
    OUT/acceptance_by_position.png (the share of verifies accepting drafted token k, per draft).
    drafts: label -> a folder holding the eval.json of `dflash-llama train --eval-only`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = set(EngineScore.__dataclass_fields__)
    scores = {}
    for label, folder in drafts.items():
        recorded = json.loads((Path(folder) / "eval.json").read_text())["scores"]
        found = [s for s in recorded if s["engine"] == engine]
        if not found:
            raise ValueError(f"{folder}/eval.json has no {engine!r} score")
        scores[label] = EngineScore(**{k: v for k, v in found[0].items() if k in fields})
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| draft | prompts | tau | acceptance rate | exact | " +
            " | ".join(f"pos {k}" for k in range(1, 8)) + " |", "|---|---:|---:|---:|---|" + "---:|" * 7]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in scores.items():
        by_pos = s.acceptance_by_position()
        exact = "" if s.exact is None else ("yes" if s.exact else "NO")
        cells = " | ".join(f"{p:.3f}" for p in by_pos) if by_pos else " | ".join(["n/a"] * 7)
        rows.append(f"| {label} | {s.prompts} | {s.tau:.3f} | {s.acceptance_rate:.3f} | {exact} | {cells} |")
        if by_pos:
            ax.plot(range(1, len(by_pos) + 1), by_pos, marker="o", label=f"{label} (tau {s.tau:.3f})")
    ax.set_xlabel("drafted token k")
    ax.set_ylabel("share of verifies accepting token k")
    ax.set_title(f"HumanEval acceptance by position ({engine})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    table = out / "table.md"
    table.write_text("\n".join(rows) + "\n")
    return table
