"""Command line: turn a ds_patrickstar checkpoint folder into one consolidated fp32 state dict.

    python -m ds_patrickstar.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]

The output is a ``torch.save``-d ``{name: tensor}`` that ``model.load_state_dict`` takes
(trainable parameters from the fp32 masters; frozen parameters and buffers from the module
state). The same as :func:`ds_patrickstar.consolidate_fp32_state_dict`.

``deepspeed_main`` is DeepSpeed's command line for the same (see [Note: the recovery script] in
io/recovery_script.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from .io.checkpoint import CheckpointError, consolidate_fp32_state_dict

logger = logging.getLogger("ds_patrickstar.zero_to_fp32")


def deepspeed_main(argv: list[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line on this stage's checkpoints (see [Note: the recovery script] in
    io/recovery_script.py)."""
    parser = argparse.ArgumentParser(description="DeepSpeed's zero_to_fp32.py, for stage 'patrickstar' checkpoints")
    parser.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint (this folder: .)")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin (or model.safetensors)")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; the state dict is written as one file")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave the frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="log at debug level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    try:
        state = consolidate_fp32_state_dict(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
    except CheckpointError as err:
        logger.error("error: %s", err)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    if args.safe_serialization:
        from safetensors.torch import save_file

        path = os.path.join(args.output_dir, "model.safetensors")
        save_file({name: value.contiguous().clone() for name, value in state.items()}, path)
    else:
        path = os.path.join(args.output_dir, "pytorch_model.bin")
        torch.save(state, path)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    logger.info("wrote %d tensors (%d bytes) to %s", len(state), nbytes, path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    parser.add_argument("output_file", help="where to torch.save the fp32 state dict")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        state = consolidate_fp32_state_dict(args.checkpoint_dir, args.tag)
    except CheckpointError as err:
        logger.error("error: %s", err)
        return 2
    torch.save(state, args.output_file)
    numel = sum(t.numel() for t in state.values())
    logger.info("wrote %d tensors (%d elements) to %s", len(state), numel, args.output_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
