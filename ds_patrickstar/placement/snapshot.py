"""The planner's inputs at its last thorough plan, written to a file and planned again from one.

[Note: planner snapshot]
Where the step-time model chooses the optimizer states (``optimizer_placement: "time"``), placement's choices
come from a pure function: the trace (its moments, their tides and readings), the budget, the owned chunks' costs,
the device profile, the moments' compute times, the chunks resident, the fill rule's candidates and the activation
offload's copies give the states on the accelerator, the prefetch distance, the eviction order and the predicted
step (see [Note: optimizer states by step time] in state_choice.py). The planner keeps those inputs of its last
thorough plan (the check at the second step, or a re-plan after a risen tide; see [Note: the plan checked on
steady times] in step_planner.py) and what it chose; ``engine.planner_snapshot(path)`` writes them as JSON, and
:func:`replan` plans again from such a file on any machine, with another budget or profile if asked: a trace and
moment times measured on a GPU can be planned again, and a planner changed, on a CPU
(``benchmarks/replan.py``). :func:`replan` with the file's own budget and profile makes the choice the run made
(``tests/test_planner_snapshot.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .bytes_floor import FloorMeter
from .chunk_costs import ChunkCosts
from .state_choice import StateChoice, StateChooser
from .step_time import ActivationMoves, DeviceProfile, HostOverlap
from .trace import Moment, Trace

VERSION = 1
_SETS = ("written", "acc_born", "acc_folding", "acc_gone", "gathered_ahead")


@dataclass(frozen=True)
class PlannerSnapshot:
    """One thorough plan's inputs (see [Note: planner snapshot]) and what it chose."""

    budget: int
    costs: ChunkCosts
    profile: DeviceProfile
    overlap: HostOverlap  # when the host Adam runs (see [Note: overlapped host Adam]; a snapshot's true: FROM_STEP)
    moments: tuple[Moment, ...]
    fill: frozenset[int]  # the chunks whose states the fill rule places: the candidates
    resident: frozenset[int]  # the chunks on the accelerator when the plan was made
    compute_s: tuple[float, ...]  # the moments' times the plan priced with
    activations: ActivationMoves
    chosen: dict[str, Any]  # states on the accelerator, distance, order, predicted step, bytes moved

    def trace(self) -> Trace:
        trace = Trace()
        for moment in self.moments:
            trace.add(moment)
        return trace

    def to_json(self) -> dict[str, Any]:
        costs = self.costs
        return {
            "version": VERSION,
            "budget": self.budget,
            "costs": {
                "sizes": _pairs(costs.sizes),
                "elements": _pairs(costs.elements),
                "capacities": _pairs(costs.capacities),
                "uncopied": sorted(costs.uncopied),
                "clean_copies": costs.clean_copies,
                "accumulators": None if costs.accumulators is None else _pairs(costs.accumulators),
            },
            "profile": asdict(self.profile),
            "overlap": int(self.overlap),
            "moments": [_moment_json(m) for m in self.moments],
            "fill": sorted(self.fill),
            "resident": sorted(self.resident),
            "compute_s": list(self.compute_s),
            "activations": {
                "out": _pairs(self.activations.out),
                "demand": _pairs(self.activations.demand),
                "ahead": [[k, [list(c) for c in copies]] for k, copies in sorted(self.activations.ahead.items())],
            },
            "chosen": self.chosen,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlannerSnapshot:
        if data.get("version") != VERSION:
            raise ValueError(f"planner snapshot version {data.get('version')!r}: this code reads version {VERSION}")
        costs = data["costs"]
        acts = data["activations"]
        return cls(
            budget=data["budget"],
            costs=ChunkCosts(
                dict(costs["sizes"]),
                dict(costs["elements"]),
                dict(costs["capacities"]),
                frozenset(costs["uncopied"]),
                costs["clean_copies"],
                None if costs["accumulators"] is None else dict(costs["accumulators"]),
            ),
            profile=DeviceProfile(**data["profile"]),
            overlap=HostOverlap(int(data["overlap"])),
            moments=tuple(_moment(m) for m in data["moments"]),
            fill=frozenset(data["fill"]),
            resident=frozenset(data["resident"]),
            compute_s=tuple(data["compute_s"]),
            activations=ActivationMoves(
                dict(acts["out"]),
                dict(acts["demand"]),
                {k: [tuple(c) for c in copies] for k, copies in acts["ahead"]},
            ),
            chosen=data["chosen"],
        )

    def write(self, path: str) -> str:
        Path(path).write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def read(cls, path: str) -> PlannerSnapshot:
        return cls.from_json(json.loads(Path(path).read_text()))


def chosen(choice: StateChoice) -> dict[str, Any]:
    """What a plan chose, as the snapshot keeps it."""
    return {
        "on_device": sorted(choice.on_device),
        "distance": choice.distance,
        "order": int(choice.order),
        "step_s": choice.step.total_s,
        "moved": choice.moved,
    }


def replan(snapshot: PlannerSnapshot, budget: int | None = None, profile: DeviceProfile | None = None) -> StateChoice:
    """The thorough plan of ``snapshot``'s inputs (see [Note: planner snapshot]), at ``budget`` and with
    ``profile`` where given. The candidates stay the fill rule's at the snapshot's budget."""
    budget = snapshot.budget if budget is None else budget
    profile = snapshot.profile if profile is None else profile
    chooser = StateChooser(budget, snapshot.costs, profile, snapshot.overlap, FloorMeter(budget, snapshot.costs))
    args = (set(snapshot.fill), snapshot.resident, snapshot.compute_s, snapshot.activations)
    return chooser(snapshot.trace(), *args, thorough=True)


def _pairs(mapping: Any) -> list[list[int]]:
    return [[k, v] for k, v in sorted(mapping.items())]


def _moment_json(moment: Moment) -> dict[str, Any]:
    data = {f.name: getattr(moment, f.name) for f in fields(moment)}
    data["chunks"] = list(moment.chunks)
    for name in _SETS:
        data[name] = sorted(data[name])
    return data


def _moment(data: dict[str, Any]) -> Moment:
    sets = {name: frozenset(data[name]) for name in _SETS}
    return Moment(
        data["label"],
        tuple(data["chunks"]),
        data["non_model"],
        traced=data["traced"],
        read=data["read"],
        read_late=data["read_late"],
        beside=data["beside"],
        written=sets["written"],
        acc_born=sets["acc_born"],
        acc_folding=sets["acc_folding"],
        acc_gone=sets["acc_gone"],
        gathered_ahead=sets["gathered_ahead"],
    )
