"""Command line: turn a ds_patrickstar checkpoint folder into one consolidated fp32 state dict.

    python -m ds_patrickstar.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]

The output is a ``torch.save``-d ``{name: tensor}`` that ``model.load_state_dict`` takes
(trainable parameters from the fp32 masters; frozen parameters and buffers from the module
state). The same as :func:`ds_patrickstar.consolidate_fp32_state_dict`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .io.checkpoint import CheckpointError, consolidate_fp32_state_dict

logger = logging.getLogger("ds_patrickstar.zero_to_fp32")


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
