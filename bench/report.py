"""bench.md from the bench.json dictionary: the numbers, the ratios, exactness per row, the plots."""

from __future__ import annotations

from pathlib import Path


def loop_costs_line(c: dict | None) -> str | None:
    """The adaptive loop's own step costs (measured once, before its first generation) in one line:
    its draft step at N = 1 against a plain decode."""
    if not c or len(c["verify_ms"]) < 2 or len(c["draft_ms"]) < 2 or not c["verify_ms"][1]:
        return None
    plain, d1 = c["verify_ms"][1], c["draft_ms"][1]
    n_max = max(n for n, ms in enumerate(c["draft_ms"]) if ms > 0)
    return (f"The loop's own step costs, measured before its first generation (block {c['block_size']}): a plain "
            f"decode {plain:.2f} ms; a draft step at N = 1 (a block of 2 positions, with the injection of a step's "
            f"2 tokens) {d1:.2f} ms, **{d1 / plain:.2f} of a plain decode**; at N = {n_max} "
            f"{c['draft_ms'][n_max]:.2f} ms ({c['draft_ms'][n_max] / plain:.2f}).")


def _f(x, digits: int = 1, suffix: str = "") -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}{suffix}"


def _yes(x: bool) -> str:
    return "yes" if x else "**no**"


def _method_cells(m: dict) -> str:
    return (f"{_f(m['tokens_per_second'])} | {_f(m['ratio_vs_runtime_ar'], 2, 'x')} | "
            f"{_f(m['median_prompt_ratio_vs_runtime_ar'], 2, 'x')} | {_f(m.get('tau'), 2)}")


def target_types_verdict(sweep: dict) -> str | None:
    """One paragraph: the fastest type measured, and the highest ceiling (what no draft can pass)."""
    by = [t for t in sweep["by_type"] if t.get("ceiling")]
    if not by:
        return None
    best = max(by, key=lambda t: t["methods"]["dflash-auto"]["ratio_vs_runtime_ar"] or 0.0)
    top = max(by, key=lambda t: t["ceiling"]["free_draft"])
    cheapest = min(by, key=lambda t: t["verify_cost"].get("2", float("inf")))
    a = best["methods"]["dflash-auto"]
    return (f"**On this machine:** the best DFlash `auto` / plain decoding measured is "
            f"{_f(a['ratio_vs_runtime_ar'], 2, 'x')} ({best['type']}; median per prompt "
            f"{_f(a['median_prompt_ratio_vs_runtime_ar'], 2, 'x')}). The cheapest verify of 2 tokens costs "
            f"{_f(cheapest['verify_cost'].get('2'), 2)} decodes ({cheapest['type']}), and the highest ceiling is "
            f"{top['ceiling']['free_draft']:.2f}x with a free draft ({top['type']}, N={top['ceiling']['free_draft_n']}), "
            f"{max(t['ceiling']['measured_draft'] for t in by):.2f}x with the measured draft step: no type can "
            f"decode faster than that with this draft's acceptance, whatever the loop chooses.")


def target_types_section(sweep: dict) -> list[str]:
    """The `--target-types` sweep: per type, decode and verify costs, the pick, DFlash / plain, exactness."""
    L: list[str] = []
    add = L.append
    add("## Target weight types (`--target-types`)\n")
    auto = ", ".join(f"{k}={v!r}" for k, v in sweep["auto_request"].items())
    auto = f"`Runtime.generate(..., {auto})`" if auto else "`Runtime.generate` with no draft_max (the runtime's default)"
    add(f"Each type's target is made from `{Path(sweep['source']).name}` ({sweep['source_type'] or 'type not declared'}) "
        f"with the pinned `llama-quantize --allow-requantize` (cached; the input's own type is used as it is), "
        f"so every type carries the input's rounding. Per type, on {len(sweep['prompts'])} prompts "
        f"({', '.join(sweep['prompts'])}), side by side in a rotated order: our plain decoding, DFlash "
        f"`auto` ({auto}) and DFlash at the cost model's pick (draft block "
        f"{sweep['block_size']}); ratios are to our plain decoding of the same type in this run.\n")
    if sweep["stopped_by_budget"]:
        add(f"**the time budget stopped the sweep after {len(sweep['prompts'])} of {sweep['prompts_planned']} "
            f"prompts** (every type and method ran on each of them)\n")
    add(f"Decode and verify costs: {sweep['verify_source']}; verify k = t_verify(k tokens) / t_decode "
        f"(1 = free, k = as dear as k decodes).\n")
    if all("llama_bench_verify_cost" in t for t in sweep["by_type"]):
        ks = list(sweep["by_type"][0]["llama_bench_verify_cost"])
        add(f"The pinned `llama-bench -p 1,{','.join(ks)} -n 0 -fa 0` on the same targets, verify k = k * pp1 / ppk "
            "(the last row's logits only, an empty cache): "
            + "; ".join(f"{t['type']} " + " / ".join(f"{v:.2f}" for v in t["llama_bench_verify_cost"].values())
                        for t in sweep["by_type"]) + f" (k = {' / '.join(ks)}).\n")
    add("Ceiling: the most DFlash / plain decoding can reach on the type, max over N of E[tokens per step](N) "
        "/ (step cost in decodes), from the same measurements: with a free draft (the verify alone) and with the "
        "measured draft step.\n")
    add("| target type | made | tensors | decode tok/s | verify 2 | verify 4 | verify 8 | ceiling, free draft "
        "| ceiling, measured draft | pick N | pick predicted tok/s |")
    add("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in sweep["by_type"]:
        v, c = t["verify_cost"], t.get("ceiling")
        tensors = ", ".join(f"{n} {k}" for k, n in t["tensor_types"].items())
        beats = "" if t["pick_predicted_beats_plain"] else " (below plain)"
        ceil = (f"{c['free_draft']:.2f}x (N={c['free_draft_n']}) | {c['measured_draft']:.2f}x (N={c['measured_draft_n']})"
                if c else "– | –")
        add(f"| {t['type']} | {'requantized' if t['requantized'] else 'the input'} | {tensors} | "
            f"{_f(t['decode_tokens_per_second'])} | {_f(v.get('2'), 2)} | {_f(v.get('4'), 2)} | {_f(v.get('8'), 2)} | "
            f"{ceil} | {t['pick']} | {_f(t['pick_predicted_tokens_per_second'])}{beats} |")
    add("")
    verdict = target_types_verdict(sweep)
    if verdict:
        add(verdict + "\n")
    add("| target type | plain tok/s | auto tok/s | auto / plain | median/prompt | tau | pick tok/s | pick / plain "
        "| median/prompt | tau | exact |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for t in sweep["by_type"]:
        m = t["methods"]
        a, p = m["dflash-auto"], m["dflash-pick"]
        exact = f"{a['exact'] + p['exact']}/{a['prompts'] + p['prompts']}" + (
            "" if a["all_exact"] and p["all_exact"] else " **not all**")
        add(f"| {t['type']} | {_f(m['runtime-ar']['tokens_per_second'])} | {_method_cells(a)} | {_method_cells(p)} | "
            f"{exact} |")
    add("")
    add("Every row (exact: the DFlash tokens equal the plain decoding's of the same type and prompt):\n")
    add("| target type | prompt | method | tokens | tok/s | tau | exact | first diff |")
    add("|---|---|---|---:|---:|---:|---|---:|")
    for r in sweep["rows"]:
        exact = "" if r["method"] == "runtime-ar" else _yes(r["exact"])
        diff = "" if r.get("first_difference") is None else f"token {r['first_difference']}"
        add(f"| {r['type']} | {r['prompt']} | {r['method']} | {r['n_tokens']} | {_f(r['tokens_per_second'])} | "
            f"{_f(r.get('tau'), 2)} | {exact} | {diff} |")
    add("")
    return L


def threads_section(study: dict) -> list[str]:
    """The thread study (bench/thread_study.py): each tool at its default and every fixed -t, per condition."""
    counts = study["thread_counts"]
    n = study.get("repeat", 1)
    repeat = f", each run {n} times per prompt, the fastest counting" if n > 1 else ""
    L = ["## Threads: each tool at its default and at every fixed -t\n",
         f"Our default loop (`--draft-max auto`, no -t: a new Runtime that measures its thread count before its "
         f"first generation) and llama-completion (no -t: llama.cpp's default), against both at "
         f"-t {', '.join(map(str, counts))}, on {len(study['prompts'])} prompts ({', '.join(study['prompts'])}), "
         f"-n {study['n_predict']}, quiet and with cores kept busy by spinning processes"
         f"{repeat}. tok/s over all tokens; "
         f"threads used: what the tool decoded with (ours: its measurement, llama.cpp: its log); exact: equal to "
         f"the main loop's reference for the prompt (our plain decoding's tokens, llama-completion's text).\n",
         "| busy cores | method | threads used | tok/s | exact |", "|---:|---|---|---:|---|"]
    for c in study["conditions"]:
        for it in c["arms"].values():
            L.append(f"| {c['busy_cores']} | {it['label']} | {', '.join(map(str, it['threads_used'])) or '–'} | "
                     f"{_f(it['tokens_per_second'])} | {it['exact']}/{it['prompts']} |")
    L += ["", "| busy cores | tool | default / its best fixed -t | median per prompt | best fixed | default's threads |",
          "|---:|---|---:|---:|---|---|"]
    for c in study["conditions"]:
        for tool, t in c["tools"].items():
            same = " (the best fixed count)" if t.get("same_count_as_best_fixed") else ""
            L.append(f"| {c['busy_cores']} | {tool} | {_f(t['default_vs_best_fixed'], 3)} | "
                     f"{_f(t['median_prompt_default_vs_best_fixed'], 3)} | {c['arms'][t['best_fixed']]['label']} | "
                     f"{', '.join(map(str, t.get('default_threads') or [])) or '–'}{same} |")
    spread = [(c["busy_cores"], c.get("repeat_spread")) for c in study["conditions"] if c.get("repeat_spread")]
    if spread:
        L += ["", "Runs of one method on one prompt spread by " + ", ".join(
            f"{100 * v:.1f}% ({b} busy)" for b, v in spread) + " (the median of (fastest - slowest) / fastest over "
            "its repeats): a default that decoded with the best fixed count is that count, and its ratio to it "
            "is this machine's noise."]
    chose = [(c["busy_cores"], next((r["threads"] for r in c["rows"] if r["arm"] == "ours-default"), None))
             for c in study["conditions"]]
    if any(line for _, line in chose):
        L += ["", "What our default chose (a plain decode step at each count, measured before its first "
                  "generation): " + "; ".join(f"{b} busy: `{line}`" for b, line in chose if line) + "."]
    return L + [""]


def machine_name(meta: dict) -> str:
    """The CPU's name with its vector extensions ("AMD EPYC (avx2 fma f16c)"); bench.json files written before
    they were recorded give the name alone."""
    simd = meta.get("simd")
    return f"{meta['cpu']} ({' '.join(simd) if simd else 'no AVX2/AVX-512/NEON'})" if simd is not None else meta["cpu"]


def _render_target_types_only(res: dict, command: str, plots: list[str]) -> str:
    s, meta, sweep = res["settings"], res["meta"], res["target_types"]
    L = [f"# Benchmark: target weight types, {Path(s['target']).name} + {Path(s['draft']).name}\n",
         "Produced by\n", f"```\n{command}\n```\n"]
    budget = s.get("budget_min")
    L.append(f"- started {meta['started']}; the whole command took {meta['command_wall_s'] / 60:.1f} min"
             + (f" (budget {budget:g} min)" if budget else ""))
    L.append(f"- machine: {machine_name(meta)}, {meta['nproc']} CPUs ({meta['affinity']} usable), {meta['platform']}; "
             f"load average {meta['loadavg_end']} at the end")
    L.append(f"- dflash-llama {meta['dflash_llama']}, llama.cpp {meta['llama_cpp']}")
    L.append(f"- -n {s['n_predict']} tokens, greedy, {s['threads']} threads, context {s['n_ctx']}; cost model on "
             f"{', '.join(s['pilot_prompts'])} ({s['calibration_tokens']}-token runs per N)\n")
    L += target_types_section(sweep)
    L += [f"![{p}]({p})\n" for p in plots]
    return "\n".join(L) + "\n"


def render(res: dict, command: str, plots: list[str]) -> str:
    if "summary" not in res:
        return _render_target_types_only(res, command, plots)
    s, meta, summ = res["settings"], res["meta"], res["summary"]
    L: list[str] = []
    add = L.append
    add(f"# Benchmark: {Path(s['target']).name} + {Path(s['draft']).name}\n")
    add("Produced by\n")
    add(f"```\n{command}\n```\n")
    budget = s.get("budget_min")
    add(f"- started {meta['started']}; the whole command took {meta['command_wall_s'] / 60:.1f} min"
        + (f" (budget {budget:g} min)" if budget else ""))
    if s.get("stopped_by_failure"):
        add(f"- **{s['stopped_by_failure']}: the run stopped after {len(s['prompts'])} of {s['prompts_planned']} "
            f"prompts** (every method ran on each of them; no serving phase or thread study)")
    if s.get("stopped_by_budget"):
        add(f"- **the time budget stopped the run after {len(s['prompts'])} of {s['prompts_planned']} prompts** "
            f"(every method ran on each of them)")
    add(f"- machine: {machine_name(meta)}, {meta['nproc']} CPUs ({meta['affinity']} usable), {meta['platform']}; "
        f"load average {meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end")
    add(f"- dflash-llama {meta['dflash_llama']}, llama.cpp {meta['llama_cpp']} (the pinned peer tools of this build)")
    add(f"- {len(s['prompts'])} prompts ({s['prompts'][0]['id']} … {s['prompts'][-1]['id']}), "
        f"-n {s['n_predict']} tokens, greedy, {s['threads']} threads, context {s['n_ctx']}; "
        f"draft block size {s['draft_block_size']}; block sizes {', '.join(map(str, s['block_sizes']))}; "
        f"--draft-max {s['draft_max']}" + (
            f"; each method ran {s['repeat']} times on each prompt (in rotating order), the fastest run counting "
            f"(`--repeat`; every run's speed in bench.json, `repeat_tokens_per_second`)" if s.get("repeat", 1) > 1
            else "") + "\n")

    add("## Summary (all prompts)\n")
    add("Speed is decode tokens per second over all prompts (tokens after the first / decode time; "
        "prefill excluded). Speedups are ratios of speeds measured in this run; \"median/prompt\" is the "
        "median of the per-prompt ratios (paired, so slow phases of the machine cancel).\n")
    add("**exact**: on how many prompts the greedy output equals the output the method must reproduce: "
        "our runtime's speculative rows, the tokens of our autoregressive decoding; llama.cpp's speculative "
        "rows, the text of the same tool decoding without drafts (`llama-speculative-simple, no drafts`); "
        "the plain decoders, each other's text. **= llama-completion**: on how many prompts the text is "
        "llama-completion's. llama-speculative-simple decodes the prompt without its last token, then that "
        "token with the first draft; llama.cpp's logits depend on how a batch is split, so at a near-tie its "
        "greedy text can leave llama-completion's even with no speculation at all.\n")
    add("| method | tok/s | vs llama-completion | median/prompt | vs our autoregressive | tau | acceptance "
        "| exact | = llama-completion |")
    add("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for it in summ.values():
        exact = f"{it['exact']}/{it['prompts']}" + ("" if it["all_exact"] else " **not all**")
        add(f"| {it['label']} | {_f(it['tokens_per_second'])} | {_f(it['speedup_vs_llama-completion'], 2, 'x')} | "
            f"{_f(it['median_prompt_speedup_vs_llama-completion'], 2, 'x')} | {_f(it['speedup_vs_runtime-ar'], 2, 'x')} | "
            f"{_f(it.get('tau'), 2)} | {_f(100 * it['acceptance_rate'] if it.get('acceptance_rate') is not None else None, 1, '%')} | "
            f"{exact} | {it['same_text_as_llama_completion']}/{it['prompts']} |")
    add("")

    add("## Ratios measured in this run\n")
    add("| ratio | over all tokens | median per prompt |")
    add("|---|---:|---:|")
    for r in res["ratios"]:
        add(f"| {r['what']} | {_f(r['ratio'], 3)} | {_f(r['median_prompt_ratio'], 3)} |")
    add("")
    if any(r["what"].endswith("prompts past -n)") for r in res["ratios"]):
        add("**At equal length**: llama-speculative-simple stops only once it has passed -n, and at its last "
            "step, asked for a draft of 0 tokens, the pin drafts without limit (it reads a budget of 0 as none: "
            "ngram-mod drafts 64), so it can decode far past -n and its speed "
            "counts tokens ours never decodes, the last ones its cheapest. On those prompts our default loop "
            "decoded the prompt again to the tool's length (exact: its first -n tokens are our plain decoding's), "
            "and the equal-length ratio compares the two over the same tokens.\n")

    cm = res["cost_model"]
    add("## Cost model: how many drafted tokens to verify\n")
    add(f"Measured on the pilot prompts ({', '.join(cm['pilot_prompts'])}; {cm['pilot_steps']} speculative steps "
        f"for the acceptance curve, {cm['calibration_tokens']}-token greedy runs per N for the step costs). "
        f"Expected speed(N) = (1 + s_1 + … + s_N) / t_step(N), s_i = fraction of steps accepting drafted "
        f"token i, t_step = draft + verify(N+1 tokens) + other.\n")
    pick = cm["pick"]
    add(f"- pick: **N = {pick['n_draft']}** (of {cm['block_size'] - 1}), predicted "
        f"{_f(pick['tokens_per_second'])} tok/s; one plain decode step predicts "
        f"{_f(cm['autoregressive_tokens_per_second'])} tok/s")
    if cm.get("used_n_draft") != pick["n_draft"]:
        add(f"- used instead: N = {cm['used_n_draft']} (given by --draft-max)")
    if cm.get("measured_key"):
        add(f"- measured for N = {cm['used_n_draft']} on all prompts ({summ[cm['measured_key']]['label']}): "
            f"**{_f(cm['measured_tokens_per_second'])} tok/s**, predicted {_f(cm.get('predicted_tokens_per_second'))} "
            f"tok/s (with the benchmark prompts' own acceptance curve: "
            f"{_f(cm.get('predicted_with_bench_acceptance'))} tok/s)")
    for c in cm.get("checks", []):
        if c["method"] != cm.get("measured_key"):
            add(f"- check, N = {c['n_draft']} ({summ[c['method']]['label']}): measured "
                f"{_f(c['measured_tokens_per_second'])} tok/s, predicted {_f(c['predicted_tokens_per_second'])} "
                f"(with the benchmark prompts' acceptance: {_f(c['predicted_with_bench_acceptance'])})")
    if pick["tokens_per_second"] < cm["autoregressive_tokens_per_second"]:
        add("- the model predicts no N beats plain decoding on this machine with this draft: "
            "verifying costs more than the accepted tokens save")
    add("")
    add("| N | E[tokens]/step | draft ms | verify ms | other ms | step ms | predicted tok/s |")
    add("|---:|---:|---:|---:|---:|---:|---:|")
    costs = {c["n_draft"]: c for c in cm["costs"]}
    for p in cm["predictions"]:
        c = costs[p["n_draft"]]
        mark = " ←" if p["n_draft"] == pick["n_draft"] else ""
        add(f"| {p['n_draft']}{mark} | {p['expected_tokens']:.2f} | {c['draft_ms']:.1f} | {c['verify_ms']:.1f} | "
            f"{c['other_ms']:.2f} | {c['step_ms']:.1f} | {p['tokens_per_second']:.1f} |")
    add("")

    adaptive = [it for it in summ.values() if it.get("policy")]
    if adaptive:
        add("## The adaptive loop (`--draft-max auto`, the default)\n")
        add("Each step verifies the N drafted tokens (0 = a plain decode, no draft forward) of the highest "
            "expected speed, from step costs measured once per run and acceptance it measures as it goes; from "
            "plain mode it re-probes drafting after 16, 64, 256 plain steps (the schedule, with all it learned, "
            "carries on from one generation to the next), greedy with an unverified draft that the plain "
            "steps after it score (`runtime/draft_policy.h`).\n")
        add("With its n-gram source (the default) a step may instead verify a continuation of the text so far "
            "found earlier in it (no draft forward), when that is expected to be faster (`runtime/ngram.h`).\n")
        add("| method | plain steps | drafting steps | n-gram steps (tokens accepted / verified) | re-probes "
            "| mean N when drafting | vs our autoregressive | median/prompt |")
        add("|---|---:|---:|---:|---:|---:|---:|---:|")
        for it in adaptive:
            pol = it["policy"]
            add(f"| {it['label']} | {pol['plain_steps']} ({_f(None if pol['plain_share'] is None else 100 * pol['plain_share'], 0, '%')}) | "
                f"{pol['draft_steps']} | {pol['ngram_steps']} ({pol['ngram_accepted']} / {pol['ngram_drafted']}) | "
                f"{pol['probes']} | {_f(pol['mean_draft'], 2)} | "
                f"{_f(it['speedup_vs_runtime-ar'], 3, 'x')} | {_f(it['median_prompt_speedup_vs_runtime-ar'], 3, 'x')} |")
        add("")
        gated = [it for it in adaptive if it["policy"].get("confidence_steps") or it["policy"].get("confidence_cut")]
        if gated:
            add("With a confidence head (DSpark), the loop cuts each draft where its confidences, calibrated online "
                "against what the target accepts, stop paying (`--draft-confidence`). Over the drafts it let through: "
                "what they accepted, and what the calibrated confidences and the loop's own estimate per block "
                "position expected before each verify.\n")
            add("| method | slots cut | drafts verified | accepted | expected by confidence | expected by position |")
            add("|---|---:|---:|---:|---:|---:|")
            for it in gated:
                pol = it["policy"]
                add(f"| {it['label']} | {pol['confidence_cut']} | {pol['confidence_steps']} | "
                    f"{pol['confidence_accepted']} | {pol['confidence_expected']:.1f} | {pol['position_expected']:.1f} |")
            add("")
        line = loop_costs_line(cm.get("loop_step_costs"))
        if line:
            add(line + "\n")

    add("## Where the time goes (our runtime, all prompts)\n")
    add("| method | prefill ms | draft ms | verify ms | other ms | verify share of decode |")
    add("|---|---:|---:|---:|---:|---:|")
    for it in summ.values():
        t = it.get("time_split_ms")
        if t:
            dec = t["total"] - t["prefill"]
            add(f"| {it['label']} | {t['prefill']:.0f} | {t['draft']:.0f} | {t['verify']:.0f} | {t['other']:.0f} | "
                f"{100 * t['verify'] / dec:.0f}% |" if dec > 0 else f"| {it['label']} | – | – | – | – | – |")
    add("")

    srv = res.get("server")
    if srv:
        patches = srv.get("patches") or []
        why_n_max = "the fastest native setting of this run" if s.get("native") else "the cost model's pick"
        add("## Serving: llama-server with native DFlash" + (", patched build" if patches else "") + "\n")
        if patches:
            add(f"llama-server built from the pinned llama.cpp with the patch series applied "
                f"(docs/upstream_status.md): {', '.join(f'`{p}`' for p in patches)}.\n")
        add(f"`/v1/completions`, greedy, {len(srv['prompts'])} of the benchmark prompts ({', '.join(srv['prompts'])}) "
            f"and -n {s['n_predict']} at each concurrency; `--spec-draft-n-max {srv['n_max']}`, "
            f"{why_n_max}. Throughput = completion tokens / wall time of the level; latency per request "
            f"(seconds). Exact: text equal to llama-completion's (at concurrency > 1 the server decodes several "
            f"sequences in one batch, which can move a near-tie).\n")
        add(f"```\n{' '.join(srv['command'])}\n```\n")
        add("| concurrency | requests | tok/s | req/s | p50 s | p90 s | p99 s | max s | acceptance | exact |")
        add("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for lv in srv["levels"]:
            lat = lv["latency_s"]
            acc = lv["acceptance_rate"]
            add(f"| {lv['concurrency']} | {lv['requests']} | {_f(lv['throughput_tokens_per_second'])} | "
                f"{_f(lv['requests_per_second'], 2)} | {lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | "
                f"{lat['max']:.2f} | {_f(100 * acc if acc is not None else None, 1, '%')} | "
                f"{lv['exact']}/{lv['requests']} |")
        add("")

    if res.get("threads"):
        L += threads_section(res["threads"])

    if res.get("target_types"):
        L += target_types_section(res["target_types"])

    add("## Plots\n")
    for p in plots:
        add(f"![{p}]({p})\n")

    add("## Every row\n")
    add("One row per prompt and method. tok/s: decode speed; tau: tokens per verify step; exact: greedy "
        "output equals the reference (see above); first diff: where it first differs.\n")
    add("| prompt | method | tokens | tok/s | tau | acceptance | exact | against | first diff | = llama-completion |")
    add("|---|---|---:|---:|---:|---:|---|---|---:|---|")
    for r in res["rows"]:
        acc = r.get("acceptance_rate")
        diff = "" if r["first_difference"] is None else f"{r['first_difference_unit']} {r['first_difference']}"
        add(f"| {r['prompt']} | {r['label']} | {r['n_tokens']} | {_f(r['tokens_per_second'])} | "
            f"{_f(r.get('tau'), 2)} | {_f(100 * acc if acc is not None else None, 1, '%')} | {_yes(r['exact'])} | "
            f"{r['exact_against']} | {diff} | {'yes' if r['same_text_as_llama_completion'] else 'no'} |")
    add("")

    add("## Method\n")
    add("- One process: our runtime (`dflash_llama.Runtime`, target + draft loaded once) and the pinned llama.cpp "
        "tools as subprocesses (each loads the model; load time is not counted). Each prompt runs every method "
        "once, in an order rotated by one method per prompt, so machine noise falls on all methods alike.")
    add("- Our runtime's speed: (generated tokens - 1) / (total - prefill time) from its own clock; "
        "llama-completion: eval runs / eval time; llama-speculative-simple: its `decoded N tokens in T s`.")
    add("- llama.cpp's native DFlash runs a block of n_max+1 tokens; block size K here means `--spec-draft-n-max K-1` "
        "(sizes above the draft's trained block are clamped by llama.cpp, so they are not run). It keeps drafting "
        "n_max tokens near the end, so it decodes past -n: its text is checked on the first -n tokens' worth.")
    add("- n-gram speculation runs with the pinned tool's default settings for each `--spec-type`. "
        "`llama-speculative-simple, no drafts` is `--spec-type ngram-simple` with lookup sizes no sequence "
        "here reaches (checked: it drafted nothing).")
    if budget:
        add(f"- The default prompt count and -n are chosen so that the whole default run fits in {budget:g} "
            f"minutes on the 2-core development machine; `--budget-min` also stops taking prompts when the next "
            f"prompt and the serving phase would not fit.")
    add("- The cost model's pick is measured on pilot prompts that are not among the benchmark prompts when "
        "enough prompts exist, then run on all benchmark prompts like every other method.")
    return "\n".join(L) + "\n"
