"""Will it fit? The model-data arithmetic of the pre-flight check, from the chunk plan alone.

[Note: pre-flight]
Before anything is allocated, the chunk plan (:func:`~ds_patrickstar.chunk_manager.plan_chunks`)
gives each rank's owned elements. Model data per rank is

* low-precision parameters (their gradients reuse the slots): ``lp_bytes`` per owned element;
* fp32 master, momentum and variance: 12 bytes per owned element;
* with gradient accumulation, an fp32 accumulator for *every* chunk the rank computes
  gradients for (all of them): 4 bytes per element of the whole model.

With placement these bytes may live on the accelerator (up to its budget) or on the host,
so the run fits when they are at most budget + available host memory. One implementation,
used by ``deepspeed.initialize``, by ``python -m ds_patrickstar.plan`` (the same functions on a
parameter count, a GPT shape or a Hugging Face config.json built on ``meta``) and by the tests
that compare it with a real run's counters.
"""
from __future__ import annotations

from dataclasses import dataclass

OPTIM_BYTES_PER_ELEMENT = 12  # fp32 master + momentum + variance
ACC_BYTES_PER_ELEMENT = 4


@dataclass(frozen=True)
class ModelDataPlan:
    owned_elements: int
    total_elements: int
    lp_bytes: int
    accumulate: bool

    @property
    def bytes_per_owned_element(self) -> int:
        return self.lp_bytes + OPTIM_BYTES_PER_ELEMENT

    @property
    def model_data_bytes(self) -> int:
        """Model data on this rank, device and host together."""
        acc = ACC_BYTES_PER_ELEMENT * self.total_elements if self.accumulate else 0
        return self.owned_elements * self.bytes_per_owned_element + acc


def plan_for_rank(capacities: list[int], owners: list[int], rank: int, lp_bytes: int,
                  accumulate: bool) -> ModelDataPlan:
    owned = sum(c for c, o in zip(capacities, owners) if o == rank)
    return ModelDataPlan(owned, sum(capacities), lp_bytes, accumulate)


def largest_fitting_params(plan: ModelDataPlan, available: int, world_size: int) -> int:
    """The most parameters whose model data fits ``available`` bytes per rank at this world size."""
    per_param = plan.bytes_per_owned_element + (ACC_BYTES_PER_ELEMENT * world_size if plan.accumulate else 0)
    return available // per_param * world_size


def check_fits(plan: ModelDataPlan, budget: int, host_available: int, world_size: int) -> None:
    """Raise ``ValueError`` when the model data cannot fit accelerator budget plus free host memory."""
    need = plan.model_data_bytes
    available = budget + host_available
    if need <= available:
        return
    fits = largest_fitting_params(plan, available, world_size)
    raise ValueError(f"the model data needs {need / 2**30:.2f} GiB on this rank ({plan.bytes_per_owned_element} "
                     f"bytes per owned parameter x {plan.owned_elements:,} owned elements"
                     f"{', + 4 bytes per parameter for gradient accumulation' if plan.accumulate else ''}) but the "
                     f"accelerator budget ({budget / 2**30:.2f} GiB) plus free host memory give "
                     f"{available / 2**30:.2f} GiB; the largest model that would fit has about "
                     f"{fits / 1e6:,.0f}M parameters at this world size")


# ---- the planner CLI: python -m ds_patrickstar.plan ----------------------------------------
def capacities_for(shapes: list[int], chunk_size: int, world_size: int) -> list[int]:
    """Chunk capacities of a model given its trainable tensors' sizes (in registration order): the
    chunk plan ``deepspeed.initialize`` makes, without building anything."""
    import torch

    from .chunk_manager import plan_chunks

    named = [(str(i), torch.empty(n, device="meta")) for i, n in enumerate(shapes)]
    return [spec.capacity for spec in plan_chunks([named], chunk_size, world_size)]


def _sizes_from_hf_config(path: str) -> list[int]:
    """Trainable tensor sizes of the Hugging Face model a ``config.json`` describes (built on ``meta``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [p.numel() for p in model.parameters() if p.requires_grad]


def _sizes_from_gpt(spec: str) -> list[int]:
    """``WIDTHxDEPTH[xVOCAB[xSEQ]]`` of benchmarks/gpt_model.GPT: its tensor sizes in order."""
    parts = [int(x) for x in spec.lower().split("x")]
    width, depth = parts[0], parts[1]
    vocab = parts[2] if len(parts) > 2 else 50304
    seq = parts[3] if len(parts) > 3 else 1024
    layer = [width, width, 3 * width * width, 3 * width, width * width, width, width, width,
             4 * width * width, 4 * width, 4 * width * width, width]
    return [vocab * width, seq * width] + layer * depth + [width, width]


def plan_report(sizes: list[int], chunk_size: int, world_size: int, lp_bytes: int, accumulate: bool,
                device_budget: int, host_bytes: int) -> dict:
    """Rank 0's model data (the rank with the most), where it would live, and the largest model that fits."""
    capacities = capacities_for(sizes, chunk_size, world_size)
    owners = [i % world_size for i in range(len(capacities))]
    plans = [plan_for_rank(capacities, owners, r, lp_bytes, accumulate) for r in range(world_size)]
    plan = max(plans, key=lambda p: p.model_data_bytes)
    need = plan.model_data_bytes
    on_device = min(need, device_budget)
    available = device_budget + host_bytes
    return {"parameters": sum(sizes), "chunks": len(capacities), "model_data_bytes_per_rank": need,
            "bytes_per_owned_parameter": plan.bytes_per_owned_element, "on_accelerator_bytes": on_device,
            "on_host_bytes": need - on_device, "fits": need <= available,
            "largest_fitting_params": largest_fitting_params(plan, available, world_size), "plan": plan}


def _bytes(text: str) -> int:
    """``24GiB``, ``80GB``, ``1.5TiB`` or a plain number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[:-len(unit)]) * factor)
    return int(float(low))


def main(argv: list[str] | None = None) -> dict:
    """``python -m ds_patrickstar.plan``: will it fit? See [Note: pre-flight]."""
    import argparse

    from .config import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(prog="python -m ds_patrickstar.plan",
                                     description="Model data per rank of a stage 'patrickstar' run, where it would "
                                                 "live, and the largest model that fits (the pre-flight arithmetic "
                                                 "of deepspeed.initialize).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="a parameter count (e.g. 1.3e9), packed in full chunks")
    what.add_argument("--hf-config", help="a Hugging Face config.json (or its folder); needs transformers")
    what.add_argument("--gpt", help="benchmarks/gpt_model.GPT as WIDTHxDEPTH[xVOCAB[xSEQ]], e.g. 2048x28")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--device-mem", default="0", help="accelerator budget per rank, e.g. 72GiB (0: none)")
    parser.add_argument("--host-mem", required=True, help="host memory free for model data per rank, e.g. 22GiB")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--gradient-accumulation", action="store_true", help="gradient_accumulation_steps > 1")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size={args.world_size}: use an integer >= 1")
    if args.params is not None:
        n = int(args.params)
        sizes = [args.chunk_size] * (n // args.chunk_size) + ([n % args.chunk_size] if n % args.chunk_size else [])
    elif args.hf_config is not None:
        sizes = _sizes_from_hf_config(args.hf_config)
    else:
        sizes = _sizes_from_gpt(args.gpt)
    report = plan_report(sizes, args.chunk_size, args.world_size, 4 if args.dtype == "fp32" else 2,
                         args.gradient_accumulation, _bytes(args.device_mem), _bytes(args.host_mem))
    gib = 2**30
    print(f"model: {report['parameters'] / 1e6:,.1f}M parameters in {report['chunks']} chunks "
          f"(chunk_size {args.chunk_size:,}), world size {args.world_size}, {args.dtype}")
    print(f"model data per rank: {report['model_data_bytes_per_rank'] / gib:.2f} GiB "
          f"({report['bytes_per_owned_parameter']} bytes per owned parameter"
          f"{' + 4 per parameter for gradient accumulation' if args.gradient_accumulation else ''})")
    print(f"where: up to {report['on_accelerator_bytes'] / gib:.2f} GiB on the accelerator (less what activations "
          f"take), {report['on_host_bytes'] / gib:.2f} GiB or more on the host")
    print(f"fits: {'yes' if report['fits'] else 'NO'}; the largest model that fits: about "
          f"{report['largest_fitting_params'] / 1e6:,.0f}M parameters at this world size")
    return report


if __name__ == "__main__":
    main()
