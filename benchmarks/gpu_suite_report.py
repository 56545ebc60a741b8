"""``gpu_suite.py``'s JSON as Markdown: the parts derived from the throughput trials (step breakdown, host
memory), the tables of ``gpu_suite.md``, and ``--to-docs``, which puts them into docs/benchmarks.md between
the ``gpu-suite`` markers of its "GPU suite" section."""
from __future__ import annotations

import json
from pathlib import Path

from bench_harness import markdown_table as _table

GIB, MB = 2**30, 1e6
BEGIN, END = "<!-- gpu-suite:begin -->", "<!-- gpu-suite:end -->"
FLOPS_FORMULA = ("TFLOPS = (6 * N + 12 * L * H * T) * tokens / step time / 1e12, N the parameters in matmuls "
                 "(without the position table; the tied embedding once), L layers, H width, T sequence length: "
                 "the attention term 12 L H T is included (tflops_6n in the JSON leaves it out); no recomputation, "
                 "no optimizer")
PART_TITLES = {"builds": "JIT builds of the ops", "lora": "LoRA past GPU memory",
               "dynamic_padding": "dynamic padding against a fixed length",
               "throughput": "throughput at 0.5x / 1.5x / 3x of GPU memory", "sweep": "equal memory",
               "gpu_tests": "GPU tests (`pytest -m gpu`)", "max_model": "largest model at a capped host memory",
               "breakdown": "where the step goes", "host_memory": "host memory against the counters"}


def _measured(parts: dict) -> list[dict]:
    return [t for t in parts.get("throughput", {}).get("trials", []) if t["status"] == "measured"]


def _breakdown_row(trial: dict) -> dict:
    phases, last = trial["phases_s"], trial["records"][-1]
    adam = trial.get("adam_s") or {}
    cpu_adam = adam.get("adam_host_s") if trial["backend"] == "ours" else adam.get("adam_s")
    row = {"size": trial["size"], "backend": trial["backend"], "step_s": trial["step_s"], **phases,
           "timing": trial["timing"], "adam_s": adam.get("adam_s"),
           "cpu_adam_s": cpu_adam if trial["backend"] != "zero3" else None}
    counters, pinned = last.get("counters"), trial.get("pinned")
    if counters:
        row.update({k: counters.get(k) for k in ("bytes_to_device", "bytes_to_host", "evictions",
                                                 "adam_chunks_host", "adam_chunks_device")})
        row["transfer_s"] = (counters["bytes_to_device"] / pinned["h2d_bytes_per_s"]
                             + counters["bytes_to_host"] / pinned["d2h_bytes_per_s"]) if pinned else None
    return row


def _host_row(trial: dict) -> dict:
    host, counters = trial["host"], trial["records"][-1].get("counters") or {}
    stats = host.get("cuda_host_memory_stats") or {}
    counted = counters.get("host_bytes_allocated")
    return {"size": trial["size"], "backend": trial["backend"], "rss_bytes": host["rss_bytes"],
            "peak_rss_bytes": host["peak_rss_bytes"], "cuda_host_allocated_bytes": stats.get("allocated_bytes.current"),
            "cuda_host_peak_bytes": stats.get("allocated_bytes.peak"), "cuda_host_note": host.get(
                "cuda_host_memory_stats_note"), "counted_host_bytes": counted,
            "model_bytes_host": counters.get("model_bytes_host"), "model_data_bytes": host.get("model_data_bytes"),
            "rss_minus_counted_bytes": host["rss_bytes"] - counted if counted is not None else None}


def derived_parts(parts: dict) -> dict:
    """Parts 4 and 5, from part 2's measured trials (no trial of their own)."""
    trials = _measured(parts)
    if not trials:
        why = {"status": "skipped", "reason": "derived from the throughput trials, and none was measured"}
        return {"breakdown": dict(why), "host_memory": dict(why)}
    return {"breakdown": {"status": "measured", "source": "throughput trials", "rows": [_breakdown_row(t)
                                                                                       for t in trials]},
            "host_memory": {"status": "measured", "source": "throughput trials", "rows": [_host_row(t)
                                                                                          for t in trials]}}


def _floor(counters: dict) -> str:
    """The MB moved cell's " (floor F)", where the engine computed the bytes floor (see [Note: the bytes floor])."""
    return f" (floor {counters['bytes_floor'] / MB:.1f})" if counters.get("bytes_floor") else ""


def _f(value, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "" if value is None else fmt.format(value / scale)


def _machine(meta: dict) -> list[str]:
    gib = _f(meta.get("gpu_memory_bytes"), "{:.0f} GiB", GIB)
    line = (f"**Machine.** {meta['gpu']}{f' ({gib})' if gib else ''}, driver {meta.get('driver')}, torch "
            f"{meta['torch']} (CUDA {meta.get('cuda')}), DeepSpeed {meta.get('deepspeed')}, Python {meta['python']}, "
            f"{meta['cpus']} CPUs, {meta['host_memory_bytes'] / GIB:.0f} GiB host memory; {meta['date']}, commit "
            f"{meta.get('git_commit')}; {_f(meta.get('wall_s'), '{:.0f}')} s of a {meta['budget_s']:.0f} s budget.")
    out = [line, "", f"`{meta['command']}`", ""]
    if meta.get("merged_from"):
        out = [line, "", "Merged from " + "; ".join(f"`{m['command']}` ({m['date']}, commit {m['git_commit']}, "
                                                   f"{_f(m.get('wall_s'), '{:.0f}')} s)" for m in meta["merged_from"])
               + ".", ""]
    if meta["dry_run"]:
        out += ["**Dry run**: ours on the strict emulated accelerator, stock ZeRO-3 on the CPU, tiny sizes: a check "
                "that the suite runs, not GPU figures.", ""]
    return out


def _why(trial: dict) -> str:
    return (trial.get("reason") or trial.get("error") or "")[-160:]


def _trials_note(part: dict) -> str:
    trials = part["trials"]
    left = [f"{' '.join(str(t[k]) for k in ('size', 'point', 'backend', 'padding') if t.get(k))}: {t['status']} "
            f"{_why(t)}" for t in trials if t["status"] != "measured"]
    return f"{sum(t['status'] == 'measured' for t in trials)} of {len(trials)} trials measured" + (
        "; " + "; ".join(left) if left else "")


def _part_note(name: str, part: dict) -> str:
    if "trials" in part:
        return _trials_note(part)
    if part.get("status") not in ("measured", "cut"):
        return part.get("reason") or part.get("error") or ""
    if name == "builds":
        return "; ".join(f"{op}: {'ok' if r['ok'] else 'FAILED ' + r.get('error', '')[-100:]} {r['seconds']:.0f} s"
                         for op, r in part["ops"].items())
    if name == "gpu_tests":
        counts = ", ".join(f"{part[k]} {k}" for k in ("passed", "failures", "errors", "skipped") if k in part)
        return f"{part.get('outcome', part.get('reason'))}: {counts}"
    if name == "max_model":
        return "; ".join(f"{b}: {r.get('stopped') or r.get('reason') or 'done'}" for b, r in part["backends"].items())
    return f"from the {part.get('source')}"


def _parts(result: dict) -> list[str]:
    rows = []
    for name, title in PART_TITLES.items():
        part = result["parts"].get(name, {"status": "not reached"})
        used = _f(part.get("seconds_used"), "{:.0f}")
        rows.append([title, part["status"], f"{used} ({_f(part.get('deadline_s'), '{:.0f}')})" if used else "",
                     _part_note(name, part).replace("|", "/").replace("\n", " ")])
    rows += [[r["row"], "not run", "", r["reason"]] for r in result.get("not_run", [])]
    return ["**Parts.**", "", *_table(["part", "status", "seconds (deadline)", "note"], rows), ""]


def _not_measured(t: dict, width: int) -> list[str]:
    """A trial's cells past its name where it was not measured: its status and why, then blanks."""
    return [t["status"], _why(t).replace("\n", " "), *[""] * (width - 2)]


def _shape(t: dict) -> str:
    o = t.get("overrides") or t.get("shape") or {}
    return f"{o['n_layer']} x {o['n_embd']}" if "n_layer" in o else ""


def _throughput(result: dict) -> list[str]:
    part = result["parts"].get("throughput", {})
    if not part.get("trials"):
        return []
    ratio = {r["size"]: r for r in part.get("ratios", [])}
    rows = []
    for t in part["trials"]:
        head = [t["size"], _f(t.get("params"), "{:.4g} M", 1e6), _shape(t),
                t["backend"] + (" (stand-in)" if t.get("stand_in") else "")]
        if t["status"] != "measured":
            rows.append(head + _not_measured(t, 9))
            continue
        r = ratio.get(t["size"], {})
        versus = r.get("ours_over_zero3_offload") if t["backend"] == "ours" else None
        rows.append(head + ["measured", f"{t['step_s'] * 1e3:.1f}", _f(t.get("spread"), "{:.0%}"),
                            f"{t['tokens_per_s']:.1f}", f"{t['tflops']:.3g}",
                            _f(t.get("gpu_max_allocated_bytes"), "{:.2f}", GIB),
                            f"{t['host']['peak_rss_bytes'] / GIB:.2f}", _f(versus, "{:.2f}x"),
                            _f(r.get("practicality", {}).get(t["backend"]), "{:.2f}x")])
    sizes = ", ".join(dict.fromkeys(t["size"] for t in part["trials"]))
    return [f"**Throughput** at model data (ours' 14 bytes/param) of {sizes} the GPU's "
            f"{_f(result['meta'].get('device_bytes'), '{:.3g}', GIB)} GiB (activation checkpointing on; median of the "
            f"timed steps, spread (max - min) / median). {result['flops']}.", "",
            *_table(["model", "params", "layers x width", "backend", "status", "step (ms)", "spread", "tokens/s",
                     "TFLOPS", "GPU max (GiB)", "peak RSS (GiB)", "ours / ZeRO-3 offload",
                     "practicality (/ no offload)"], rows), "", *_first_steps(result), ""]


def _first_steps(result: dict) -> list[str]:
    """The warm-up steps' extra seconds over as many steady steps, per measured trial, on a line of their own."""
    cells = []
    for name in ("lora", "dynamic_padding", "throughput", "sweep"):
        for t in result["parts"].get(name, {}).get("trials", []):
            if t["status"] == "measured" and "first_steps_extra_s" in t:
                who = " ".join(str(t[k]) for k in ("size", "point", "backend", "padding") if t.get(k))
                cells.append(f"{name} {who}: {t['warmup_steps']} warm-up steps, "
                             f"{t['first_steps_extra_s']:+.2f} s over steady{_warmup_phases(t)}")
    return ["**First steps** (their extra time over the steady median; per warm-up step: seconds, forward / backward "
            "/ `engine.step()` in ms, and ours' planning, counter `plan_seconds`, with the plan it made: the "
            "optimizer states its Adam updated on the GPU / on the host, the plan's forecast `planned_step_s`; the "
            "activations the step offloaded and the host buffers it pinned): "
            + "; ".join(cells) + "."] if cells else []


def _warmup_phases(trial: dict) -> str:
    steps = []
    for r in trial.get("warmup_records", []):
        counters = r.get("counters") or {}
        planned = counters.get("plan_seconds")
        phases = " / ".join(f"{r[k] * 1e3:.0f}" for k in ("forward", "backward", "step") if k in r)
        plan = ""
        if planned:
            plan = (f", planned {planned:.2f} s: {counters.get('adam_chunks_device', '?')} / "
                    f"{counters.get('adam_chunks_host', '?')} states, "
                    f"forecast {_f(counters.get('planned_step_s'), '{:.3f} s') or 'n/a'}")
        offloaded = counters.get("activation_bytes_offloaded")
        if offloaded:
            pinned = counters.get("host_pinnings", "?")
            plan += f", {offloaded / 1e9:.2f} GB of activations offloaded, {pinned} host buffers pinned"
        steps.append(f"{r['wall_s']:.2f} s ({phases}{plan})")
    return f" ({', '.join(steps)})" if steps else ""


def _sweep(result: dict) -> list[str]:
    part = result["parts"].get("sweep", {})
    if not part.get("trials"):
        return []
    ratio = {(r["point"], rule): r.get(f"{key}_over_zero3_offload") for r in part.get("ratios", [])
             for rule, key in (("time", "ours"), ("fill", "ours_fill"))}
    rows = []
    for t in part["trials"]:
        backend = t["backend"] + (" (fill)" if t.get("rule") == "fill" else "")  # ours: the default rule, time
        head = [t["point"], backend, f"{t['budget_bytes'] / GIB:.3g}"]
        if t["status"] != "measured":
            rows.append(head + _not_measured(t, 10))
            continue
        counters = t["records"][-1].get("counters") or {}
        moved = (counters["bytes_to_device"] + counters["bytes_to_host"]) if "bytes_to_device" in counters else None
        phases = t["phases_s"]
        ahead = f" ({counters['prefetch_distance']} ahead)" if counters.get("prefetch_distance") else ""
        order = counters.get("eviction_order", 0)  # see EvictionOrder: 1 and 3 free first, 2 and 3 accumulators kept
        ahead += (", free first" if order in (1, 3) else "") + (", accumulators kept" if order in (2, 3) else "")
        if counters.get("host_updates_in_backward") or counters.get("host_updates_redone"):
            ahead += (f", host updates begun in backward: {counters.get('host_updates_in_backward', 0)} kept, "
                      f"{counters.get('host_updates_redone', 0)} redone")
        rows.append(head + ["measured", f"{t['tokens_per_s']:.1f}",
                            _f(ratio.get((t["point"], t.get("rule"))), "{:.2f}x"),
                            _f(moved, "{:.1f}", MB) + _floor(counters),
                            *(f"{phases[k] * 1e3:.1f}" for k in ("forward", "backward", "step")),
                            _f(t.get("gpu_max_allocated_bytes"), "{:.2f}", GIB),
                            f"{t['step_s']:.3f} / {_f(t.get('predicted_step_s'), '{:.3f}') or 'n/a'}"
                            f" / {_f(t.get('planned_step_s'), '{:.3f}') or 'n/a'}{ahead}"])
    size = part["trials"][0]
    return [f"**Equal memory** ({size['size']}, {_f(size.get('params'), '{:.4g} M', 1e6)} params: ours at "
            "`device_budget` B, ZeRO-3 offload held to B by `torch.cuda.set_per_process_memory_fraction`; a point's "
            "GiB are an 80 GB GPU's, scaled by this GPU's memory, or this GPU's where the command has "
            "`--sweep-absolute`; B in GiB; MB moved: ours' counters, bytes_to_device + "
            "bytes_to_host of the last step (floor: the fewest any placement of the trace moves, `bytes_floor`); "
            "predicted: the engine's `predicted_step_s` counter (the step's moves priced with the previous "
            "iteration's times), planned: its `planned_step_s` (the plan's forecast when it was chosen), n/a "
            "without them, "
            "and the moments it prefetches ahead (`prefetch_distance`, see docs/placement.md), \"free first\" "
            "where it evicts unchanged chunks first and \"accumulators kept\" where evicted payloads leave their "
            "gradient accumulators on the GPU (`eviction_order`), and the host updates begun in backward that the "
            "step kept and redid (`host_updates_in_backward`, `host_updates_redone`, where any began); "
            "ours: `optimizer_placement` \"time\" (the default), ours (fill): \"fill\", the rule before the "
            "step-time model).",
            "", *_table(["point", "backend", "B (GiB)", "status", "tokens/s", "ours / ZeRO-3 offload",
                         "MB moved / step", "forward (ms)", "backward (ms)", "engine.step() (ms)", "GPU max (GiB)",
                         "step measured / predicted / planned (s)"], rows), ""]


def _lora(result: dict) -> list[str]:
    trials = result["parts"].get("lora", {}).get("trials", [])
    if not trials:
        return []
    rows = []
    for t in trials:
        if t["status"] != "measured":
            rows.append([t["size"], "", "", t["backend"], *_not_measured(t, 5)])
            continue
        rows.append([t["size"], f"{t['params'] / 1e6:.4g} M", f"{t['trainable_params'] / 1e6:.3g} M", t["backend"],
                     "measured", f"{t['tokens_per_s']:.1f}", _f(t.get("gpu_max_allocated_bytes"), "{:.2f}", GIB),
                     f"{t['host']['peak_rss_bytes'] / GIB:.2f}", ", ".join(f"{x:.4f}" for x in t["losses"])])
    return ["**LoRA past GPU memory** (adapters on every linear layer of the blocks, the rest frozen; ours' device "
            "budget below the frozen base).", "",
            *_table(["model", "params", "trainable", "backend", "status", "tokens/s", "GPU max (GiB)",
                     "peak RSS (GiB)", "losses"], rows), ""]


def _dynamic_padding(result: dict) -> list[str]:
    trials = result["parts"].get("dynamic_padding", {}).get("trials", [])
    if not trials:
        return []
    rows = [[t["size"], t["backend"], t.get("padding", "fixed, dynamic"), *(["measured", f"{t['tokens_per_s']:.1f}",
                                                       *_padding_phases(t),
                                                       _f(t.get("gpu_max_allocated_bytes"), "{:.2f}", GIB)]
                                                      if t["status"] == "measured" else _not_measured(t, 7))]
            for t in trials]
    return ["**Dynamic padding** (each step's batch padded to its own longest sequence, tokens/s of the tokens "
            "run, against a fixed length; forward and backward: medians of the timed steps; pinnings: host buffers "
            "ours' host pool pinned in the timed steps, counter `host_pinnings`; gave way: the timed steps' moments "
            "whose chunks fit only once activations, then optimizer states, left the GPU, and those that went on "
            "beside the memory then instead of the tide planned, counters `activations_gave_way` / `states_gave_way` / "
            "`planned_tide_set_aside`).", "",
            *_table(["model", "backend", "padding", "status", "tokens/s", "forward (ms)", "backward (ms)",
                     "pinnings / timed steps", "gave way", "GPU max (GiB)"], rows), ""]


def _padding_phases(trial: dict) -> list[str]:
    phases = trial.get("phases_s", {})
    pinnings = [r.get("counters", {}).get("host_pinnings") for r in trial.get("records", [])]
    pinned = f"{sum(pinnings)} / {len(pinnings)}" if pinnings and None not in pinnings else ""
    gave = [[r.get("counters", {}).get(k) for r in trial.get("records", [])]
            for k in ("activations_gave_way", "states_gave_way", "planned_tide_set_aside")]
    gave_way = " / ".join(str(sum(g)) for g in gave) if all(g and None not in g for g in gave) else ""
    return [_f(phases.get("forward"), "{:.1f}", 1e-3), _f(phases.get("backward"), "{:.1f}", 1e-3), pinned, gave_way]


def _breakdown(result: dict) -> list[str]:
    rows = result["parts"].get("breakdown", {}).get("rows", [])
    if not rows:
        return []
    body = [[r["size"], r["backend"], f"{r['step_s'] * 1e3:.1f}", *(f"{r[k] * 1e3:.1f}" for k in
            ("forward", "backward", "step", "other")), _f(r.get("adam_s"), "{:.1f}", 1e-3),
             _f(r.get("cpu_adam_s"), "{:.1f}", 1e-3), _f(r.get("bytes_to_device"), "{:.1f}", MB),
             _f(r.get("bytes_to_host"), "{:.1f}", MB), _f(r.get("transfer_s"), "{:.1f}", 1e-3),
             "" if r.get("adam_chunks_host") is None else f"{r['adam_chunks_host']}/{r['adam_chunks_device']}"]
            for r in rows]
    return ["**Where the step goes** (ms, median; phases by CUDA events on the current stream, or the clock on "
            "the CPU; `engine.step()` holds the optimizer; Adam: host wall time in the optimizer's Adam, its methods "
            "wrapped in the trial (ours: `adam.apply`, with the copies it waits for; ZeRO-3: its inner optimizer's "
            "`step`), CPU Adam: of that, the host kernel (ours: `adam._update` on host chunks; ZeRO-3 offload: all "
            "of it); ours' MB moved are its counters' bytes_to_device / bytes_to_host of the last step, their ms at "
            "the pinned bandwidth measured in the trial).", "",
            *_table(["model", "backend", "step", "forward", "backward", "engine.step()", "other", "Adam", "CPU Adam",
                     "MB to device", "MB to host", "transfers (ms)", "Adam chunks host/device"], body), ""]


def _host_memory(result: dict) -> list[str]:
    rows = result["parts"].get("host_memory", {}).get("rows", [])
    if not rows:
        return []
    body = [[r["size"], r["backend"], f"{r['rss_bytes'] / GIB:.3f}", f"{r['peak_rss_bytes'] / GIB:.3f}",
             _f(r["cuda_host_allocated_bytes"], "{:.3f}", GIB) or (r.get("cuda_host_note") or ""),
             _f(r["cuda_host_peak_bytes"], "{:.3f}", GIB), _f(r["counted_host_bytes"], "{:.3f}", GIB),
             _f(r["model_bytes_host"], "{:.3f}", GIB), _f(r.get("model_data_bytes"), "{:.3f}", GIB),
             _f(r["rss_minus_counted_bytes"], "{:.3f}", GIB)] for r in rows]
    return ["**Host memory** (GiB, after the last step; RSS from psutil, the CUDA host allocator from "
            "`torch.cuda.host_memory_stats()`, ours' counted bytes from its counters: host_bytes_allocated, "
            "model_bytes_host; model data on all devices from `bench_utils.model_data_bytes`, which for ZeRO-3 "
            "counts its partitions, fp32 masters, gradients and Adam states wherever they live).", "",
            *_table(["model", "backend", "RSS", "peak RSS", "CUDA host allocated", "CUDA host peak",
                     "counted host bytes", "model data on host", "model data, all devices", "RSS - counted"],
                   body), ""]


def _max_model(result: dict) -> list[str]:
    part = result["parts"].get("max_model", {})
    if not part.get("backends"):
        return []
    rows = []
    for name, found in part["backends"].items():
        if found.get("status") == "skipped":
            rows.append([name, "", "", "", "", "", "", "0", found["reason"]])
            continue
        best = next((t for t in found["tries"] if t["depth"] == found["largest_depth"]), None)
        steps = (best or {}).get("step_times") or []
        rows.append([name + (" (stand-in)" if found.get("stand_in") else ""), _f(found["largest_depth"], "{:.0f}"),
                     _f(best and best["params"], "{:.4g} M", 1e6), _f(best and best["peak_host_bytes"], "{:.2f}", GIB),
                     _f(steps[-1] if steps else None, "{:.2f}"), _f(found["smallest_failed_depth"], "{:.0f}"),
                     "yes" if found["exact"] else "no: a lower bound", str(len(found["tries"])),
                     found.get("stopped") or ""])
    return [f"**Largest model** (width {part['width']}, sequence {part['seq_len']}, 2 steps per try, host memory "
            f"capped at {part['host_cap_gib']:.1f} GiB for all the try's processes).", "",
            *_table(["backend", "largest depth", "params", "peak host (GiB)", "step (s)", "smallest failed depth",
                     "exact", "tries", "stopped"], rows), ""]


def _host_profiles(result: dict, top: int = 8) -> list[str]:
    """Ours' sweep trials' extra step under cProfile: the functions with the most host time of their own."""
    trials = [t for t in result["parts"].get("sweep", {}).get("trials", []) if t.get("host_profile")]
    lines = []
    for t in trials:
        profile = t["host_profile"]
        rows = [[r["function"], str(r["calls"]), f"{r['own_s'] * 1e3:.1f}", f"{r['cumulative_s'] * 1e3:.1f}"]
                for r in profile["rows"][:top]]
        lines += [f"**Host time of one step** ({t['point']}, ours{' (fill)' if t.get('rule') == 'fill' else ''}, "
                  f"cProfile, {profile['wall_s']:.3f} s with the profiler on, of which "
                  f"{profile.get('ds_patrickstar_own_s', 0.0):.3f} s in ds_patrickstar's own functions).", "",
                  *_table(["function", "calls", "own (ms)", "cumulative (ms)"], rows), ""]
    return lines


def render(result: dict) -> str:
    lines = [*_machine(result["meta"]), *_parts(result), *_lora(result), *_dynamic_padding(result),
             *_throughput(result), *_sweep(result), *_host_profiles(result), *_breakdown(result),
             *_host_memory(result), *_max_model(result)]
    return "\n".join(lines).rstrip() + "\n"


def to_docs(json_path: Path, docs: Path) -> None:
    """Replace what stands between the gpu-suite markers of ``docs`` by the tables of ``json_path``."""
    text = docs.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{docs} has no {BEGIN} ... {END} markers (the 'GPU suite' section)")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    docs.write_text(f"{head}{BEGIN}\n{render(json.loads(json_path.read_text()))}{END}{tail}")
