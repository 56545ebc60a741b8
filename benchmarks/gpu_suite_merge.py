"""``gpu_suite.py --merge``: the JSON files of runs that each ran some parts (a first lent GPU call and a
second one, say) as the result of one run. A part a file did not run (``--parts`` left it out) takes the
other file's; a part both ran merges its trials (the later file's trial replaces the earlier one's with the
same size, backend, padding, point and rule, unless the later one was not measured and the earlier one was)."""
from __future__ import annotations

import copy

from gpu_suite_parts import part_result, ratios, sweep_ratios

NOT_AMONG = "not among --parts"
TRIAL_KEY = ("size", "backend", "padding", "point", "rule")
DERIVED = ("breakdown", "host_memory")  # recomputed from the merged throughput trials
RATIOS = {"throughput": ratios, "sweep": sweep_ratios}


def _ran(part: dict | None) -> bool:
    return bool(part) and not (part.get("status") == "skipped" and part.get("reason") == NOT_AMONG)


def _merge_trials(name: str, old: dict, new: dict) -> dict:
    trials = {tuple(t.get(k) for k in TRIAL_KEY): t for t in old["trials"]}
    for t in new["trials"]:
        key = tuple(t.get(k) for k in TRIAL_KEY)
        if key not in trials or t["status"] == "measured" or trials[key]["status"] != "measured":
            trials[key] = t
    merged = list(trials.values())
    extra = {"ratios": RATIOS[name](merged)} if name in RATIOS else {}
    timing = {k: old.get(k, 0.0) + new.get(k, 0.0) for k in ("seconds_used", "deadline_s") if k in old or k in new}
    return {**part_result(merged, **extra), **timing}


def merge_part(name: str, old: dict | None, new: dict | None) -> dict | None:
    if not _ran(new):
        return old if _ran(old) else (new or old)
    if not _ran(old):
        return new
    if "trials" in old and "trials" in new:
        return _merge_trials(name, old, new)
    return new if new.get("status") == "measured" or old.get("status") != "measured" else old


def merge(results: list[dict]) -> dict:
    """One result of several runs' (in order: a later run's measured trials win)."""
    out = copy.deepcopy(results[0])
    for result in results[1:]:
        for name in dict.fromkeys([*out["parts"], *result["parts"]]):
            if name not in DERIVED:
                out["parts"][name] = merge_part(name, out["parts"].get(name), result["parts"].get(name))
        out["not_run"] = [*out.get("not_run", []), *result.get("not_run", [])]
    meta = out["meta"]
    meta["merged_from"] = [{k: r["meta"].get(k) for k in ("command", "date", "git_commit", "gpu", "wall_s")}
                           for r in results]
    meta["wall_s"] = sum(r["meta"].get("wall_s") or 0.0 for r in results)
    meta["budget_s"] = sum(r["meta"].get("budget_s") or 0.0 for r in results)
    for name in DERIVED:
        out["parts"].pop(name, None)
    return out
