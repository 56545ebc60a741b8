"""The planner's command line: ``python -m ds_patrickstar.plan``. Will a model fit, and where would
its model data live? The arithmetic is the pre-flight check's (:mod:`ds_patrickstar.memory.preflight`,
see [Note: pre-flight]) on the chunk plan ``deepspeed.initialize`` would make, from a parameter
count, a GPT shape or a Hugging Face ``config.json`` built on ``meta``; with ``--frozen-params``, a
frozen base beside them (a LoRA run: the adapters trainable, the base in frozen chunks, see
[Note: frozen chunks]).
"""

from __future__ import annotations

import torch

from .chunks.chunk_map import owner_of
from .chunks.layout import ChunkSpec, plan_chunks
from .disk.budget import disk_buffer_bytes, disk_plan, frozen_host_slots, frozen_pool_bytes, record_bytes
from .disk.swap_layout import PIECE_ELEMENTS, frozen_record_bytes, piece_elements
from .memory.preflight import (
    ACC_BYTES_PER_ELEMENT,
    OPTIM_BYTES_PER_ELEMENT,
    largest_fitting_params,
    largest_frozen_params,
    largest_group_bytes,
    plan_for_specs,
)

__all__ = ["capacities_for", "main", "plan_report", "sizes_from_gpt", "sizes_from_hf_config", "specs_for"]


def specs_for(
    shapes: list[int], chunk_size: int, world_size: int, frozen_shapes: list[int] | None = None
) -> list[ChunkSpec]:
    """The chunk plan ``deepspeed.initialize`` makes for a model given its trainable tensors' sizes (in
    registration order) and its frozen ones', without building anything."""
    named = [(str(i), torch.nn.Parameter(torch.empty(n, device="meta"))) for i, n in enumerate(shapes)]
    frozen = [
        (f"frozen{i}", torch.nn.Parameter(torch.empty(n, device="meta"), requires_grad=False))
        for i, n in enumerate(frozen_shapes or [])
    ]
    return plan_chunks([named], chunk_size, world_size, frozen)


def capacities_for(shapes: list[int], chunk_size: int, world_size: int) -> list[int]:
    """Chunk capacities of a model given its trainable tensors' sizes (in registration order)."""
    return [spec.capacity for spec in specs_for(shapes, chunk_size, world_size)]


def sizes_from_hf_config(path: str) -> list[int]:
    """Trainable tensor sizes of the Hugging Face model a ``config.json`` describes (built on ``meta``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [p.numel() for p in model.parameters() if p.requires_grad]


def sizes_from_gpt(spec: str) -> list[int]:
    """``WIDTHxDEPTH[xVOCAB[xSEQ]]`` of benchmarks/gpt_model.GPT: its tensor sizes in order."""
    parts = [int(x) for x in spec.lower().split("x")]
    width, depth = parts[0], parts[1]
    vocab = parts[2] if len(parts) > 2 else 50304
    seq = parts[3] if len(parts) > 3 else 1024
    layer = [
        width,
        width,
        3 * width * width,
        3 * width,
        width * width,
        width,
        width,
        width,
        4 * width * width,
        4 * width,
        4 * width * width,
        width,
    ]
    return [vocab * width, seq * width] + layer * depth + [width, width]


def plan_report(
    sizes: list[int],
    chunk_size: int,
    world_size: int,
    lp_bytes: int,
    accumulate: bool,
    device_budget: int,
    host_bytes: int,
    disk_buffers: int | None = None,
    disk_piece: int = PIECE_ELEMENTS,
    frozen_sizes: list[int] | None = None,
) -> dict:
    """Rank 0's model data (the rank with the most), where it would live, the most a chunk group in
    use takes on the accelerator (which a ``device_budget`` must hold, see [Note: chunk group bytes]),
    and the largest model that fits (with a frozen base: the most trainable parameters beside it, and the
    largest frozen base beside these trainable parameters); ``disk_buffers`` (the disk tier's ``buffer_count``;
    ``disk_piece``: its ``buffer_size``): the states that do not fit the host go to disk (see
    [Note: disk tier plan]); ``frozen_sizes``: the frozen tensors' sizes (see [Note: frozen chunks])."""
    specs = specs_for(sizes, chunk_size, world_size, frozen_sizes)
    capacities = [spec.capacity for spec in specs]
    group = largest_group_bytes(specs, lp_bytes, world_size, accumulate)
    owners = [owner_of(i, world_size) for i in range(len(capacities))]
    plans = [plan_for_specs(specs, world_size, r, lp_bytes, accumulate) for r in range(world_size)]
    rank = max(range(world_size), key=lambda r: plans[r].model_data_bytes)
    plan = plans[rank]
    need = plan.model_data_bytes
    on_device = min(need, device_budget)
    available = device_budget + host_bytes
    disk: dict = {}
    frozen_in_memory, buffers = plan.frozen_bytes, 0
    if disk_buffers is not None:
        owned = {i: c for i, c in enumerate(capacities) if owners[i] == rank and specs[i].kind.trainable}
        mine = [i for i in range(len(capacities)) if owners[i] == rank and not specs[i].kind.trainable]
        frozen = {i: frozen_record_bytes(capacities[i], lp_bytes) for i in mine}  # [Note: frozen chunks on disk]
        piece = piece_elements(disk_piece)
        other = need - OPTIM_BYTES_PER_ELEMENT * plan.owned_elements
        budget = host_bytes + device_budget
        slots = frozen_host_slots(disk_buffers, host_accelerator=device_budget == 0)
        buffers_of = (disk_buffers, piece, slots, disk_buffers)
        spilled, frozen_out = disk_plan(owned, frozen, other, budget, buffers_of, not accumulate)
        frozen_disk = [frozen[c] for c in frozen_out]
        buffers = disk_buffer_bytes([owned[c] for c in spilled], disk_buffers, piece)
        buffers += frozen_pool_bytes(frozen_disk, slots, disk_buffers)
        on_disk = sum(record_bytes(owned[c]) for c in spilled) + sum(frozen_disk)
        need = need - OPTIM_BYTES_PER_ELEMENT * sum(owned[c] for c in spilled) - sum(frozen_disk) + buffers
        frozen_in_memory -= sum(frozen_disk)
        on_device = min(need, device_budget)
        ram_per_param = plan.lp_bytes + (ACC_BYTES_PER_ELEMENT if accumulate else 0) * world_size
        all_buffers = disk_buffer_bytes(list(owned.values()), disk_buffers, piece)
        disk = {
            "on_disk_bytes": on_disk,
            "disk_buffer_bytes": buffers,
            "disk_piece_elements": piece,
            "spilled_chunks": len(spilled),
            "frozen_chunks_disk": len(frozen_out),
            "frozen_bytes_disk": sum(frozen_disk),
            "largest_fitting_params_disk": max(0, available - all_buffers) // ram_per_param * world_size,
        }
    return {
        "parameters": sum(sizes),
        "frozen_parameters": sum(frozen_sizes or []),
        "frozen_bytes_per_rank": plan.frozen_bytes,
        # model_data_bytes_per_rank = trainable + frozen in memory + the disk tier's buffers
        "trainable_bytes_in_memory": need - frozen_in_memory - buffers,
        "frozen_bytes_in_memory": frozen_in_memory,
        "chunks": len(capacities),
        "model_data_bytes_per_rank": need,
        "bytes_per_owned_parameter": plan.bytes_per_owned_element,
        "on_accelerator_bytes": on_device,
        "on_host_bytes": need - on_device,
        "largest_group_bytes": group,
        "fits": need <= available and (device_budget == 0 or group <= device_budget),
        "largest_fitting_params": largest_fitting_params(plan, available, world_size),
        "largest_frozen_params": largest_frozen_params(plan, available, world_size) if frozen_sizes else 0,
        "plan": plan,
        **disk,
    }


def _size(text: str) -> int:
    """argparse's type for sizes: :func:`~ds_patrickstar.integration.sizes.parse_bytes`, its message kept."""
    import argparse

    from .integration.sizes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _print_model_data(report: dict, args) -> None:
    """The model data line and its parts (they add up to it), then the frozen base's bytes in memory and on disk."""
    gib, lp = 2**30, 4 if args.dtype == "fp32" else 2
    accumulation = " + 4 per parameter for gradient accumulation" if args.gradient_accumulation else ""
    parts = [
        f"trainable {report['trainable_bytes_in_memory'] / gib:.2f} GiB "
        f"({report['bytes_per_owned_parameter']} bytes per owned parameter{accumulation}"
        f"{', less the 12 on disk of the spilled chunks' if args.disk is not None else ''})"
    ]
    if report["frozen_parameters"]:
        parts.append(f"frozen {report['frozen_bytes_in_memory'] / gib:.2f} GiB ({lp} bytes per owned frozen parameter)")
    if args.disk is not None:
        parts.append(f"disk tier buffers {report['disk_buffer_bytes'] / gib:.2f} GiB")
    print(f"model data per rank, in memory: {report['model_data_bytes_per_rank'] / gib:.2f} GiB = {' + '.join(parts)}")
    if report["frozen_parameters"]:
        on_disk = f", {report['frozen_bytes_disk'] / gib:.2f} GiB of it on disk" if args.disk is not None else ""
        print(
            f"frozen base: {report['frozen_parameters'] / 1e6:,.1f}M parameters, "
            f"{report['frozen_bytes_per_rank'] / gib:.2f} GiB per rank (no gradient, master or optimizer state)"
            f"{on_disk}"
        )


def _full_chunks(n: int, chunk_size: int) -> list[int]:
    """``n`` parameters as tensors that fill chunks."""
    return [chunk_size] * (n // chunk_size) + ([n % chunk_size] if n % chunk_size else [])


def main(argv: list[str] | None = None) -> dict:
    """``python -m ds_patrickstar.plan``: will it fit? See [Note: pre-flight]."""
    import argparse

    from .integration.config import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(
        prog="python -m ds_patrickstar.plan",
        description="Model data per rank of a stage 'patrickstar' run, where it would "
        "live, and the largest model that fits (the pre-flight arithmetic "
        "of deepspeed.initialize).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="a parameter count (e.g. 1.3e9), packed in full chunks")
    what.add_argument("--hf-config", help="a Hugging Face config.json (or its folder); needs transformers")
    what.add_argument("--gpt", help="benchmarks/gpt_model.GPT as WIDTHxDEPTH[xVOCAB[xSEQ]], e.g. 2048x28")
    parser.add_argument(
        "--frozen-params",
        type=float,
        default=0,
        help="frozen parameters beside the trainable ones (e.g. a LoRA base of 7e9 with --params for the "
        "adapters): the payload only, 2 bytes each in bf16/fp16, 4 in fp32",
    )
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument(
        "--device-mem", type=_size, default=0, help="accelerator budget per rank, e.g. 72GiB or 80GB (0: none)"
    )
    parser.add_argument(
        "--host-mem", type=_size, required=True, help="host memory free for model data per rank, e.g. 22GiB"
    )
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--gradient-accumulation", action="store_true", help="gradient_accumulation_steps > 1")
    parser.add_argument(
        "--disk",
        type=int,
        nargs="?",
        const=4,
        default=None,
        metavar="BUFFERS",
        help="with the disk tier (offload_optimizer nvme; its buffer_count, default 4): states that do not "
        "fit the host go to disk",
    )
    parser.add_argument(
        "--disk-piece",
        type=int,
        default=PIECE_ELEMENTS,
        metavar="ELEMENTS",
        help=f"with --disk: elements of the piece each buffer holds (offload_optimizer.buffer_size, default "
        f"{PIECE_ELEMENTS:,})",
    )
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size={args.world_size}: use an integer >= 1")
    if args.params is not None:
        sizes = _full_chunks(int(args.params), args.chunk_size)
    elif args.hf_config is not None:
        sizes = sizes_from_hf_config(args.hf_config)
    else:
        sizes = sizes_from_gpt(args.gpt)
    frozen = _full_chunks(int(args.frozen_params), args.chunk_size)
    report = plan_report(
        sizes,
        args.chunk_size,
        args.world_size,
        4 if args.dtype == "fp32" else 2,
        args.gradient_accumulation,
        args.device_mem,
        args.host_mem,
        args.disk,
        args.disk_piece,
        frozen,
    )
    gib = 2**30
    print(
        f"model: {report['parameters'] / 1e6:,.1f}M parameters in {report['chunks']} chunks "
        f"(chunk_size {args.chunk_size:,}), world size {args.world_size}, {args.dtype}"
    )
    _print_model_data(report, args)
    print(
        f"where: up to {report['on_accelerator_bytes'] / gib:.2f} GiB on the accelerator (less what activations "
        f"take), {report['on_host_bytes'] / gib:.2f} GiB or more on the host"
    )
    parts = "its chunks beside this rank's own and its joined buffers" if args.world_size > 1 else "one chunk"
    accumulation = ", with what gradient accumulation adds" if args.gradient_accumulation else ""
    print(
        f"the largest chunk group a moment uses takes {report['largest_group_bytes'] / gib:.3f} GiB on the "
        f"accelerator ({parts}{accumulation}): a device budget must hold it"
    )
    if args.disk is not None:
        print(
            f"disk tier, per rank: {report['on_disk_bytes'] / gib:.2f} GiB on disk (the optimizer states of "
            f"{report['spilled_chunks']} chunks, {report['frozen_chunks_disk']} frozen chunks: "
            f"{report['frozen_bytes_disk'] / gib:.2f} GiB); its host buffers, counted in the model data above: "
            f"{args.disk} + 1 pieces of {report['disk_piece_elements']:,} elements' states where states spill, "
            f"{args.disk} frozen chunks where frozen chunks are on disk; with "
            f"every state on disk about "
            f"{report['largest_fitting_params_disk'] / 1e6:,.0f}M parameters fit host and accelerator"
        )
    in_memory = " with every state in memory" if args.disk is not None else ""
    if frozen:
        print(
            f"fits: {'yes' if report['fits'] else 'NO'}; beside this frozen base, the largest trainable model "
            f"that fits: about {report['largest_fitting_params'] / 1e6:,.0f}M parameters; with these "
            f"{report['parameters'] / 1e6:,.1f}M trainable parameters, the largest frozen base that fits: about "
            f"{report['largest_frozen_params'] / 1e6:,.0f}M parameters (at this world size{in_memory})"
        )
        return report
    print(
        f"fits: {'yes' if report['fits'] else 'NO'}; the largest model that fits: about "
        f"{report['largest_fitting_params'] / 1e6:,.0f}M parameters at this world size{in_memory}"
    )
    return report


if __name__ == "__main__":
    main()
