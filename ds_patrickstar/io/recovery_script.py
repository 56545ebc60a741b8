"""The script a save writes where DeepSpeed writes its ``zero_to_fp32.py``.

[Note: the recovery script]
Stock DeepSpeed copies its ``zero_to_fp32.py`` into every ``save_dir`` (beside ``latest``), and users run
``python zero_to_fp32.py . OUTPUT_DIR``. Its reader cannot read this stage's files, so a save here writes
:data:`RECOVERY_SCRIPT` there instead (``CheckpointingEngine._copy_recovery_script``): DeepSpeed's command
line (``-t/--tag``, ``--safe_serialization``, ``--exclude_frozen_parameters``, ``--max_shard_size``, ``-d``),
:func:`ds_patrickstar.zero_to_fp32.deepspeed_main` behind it, writing ``pytorch_model.bin`` (or
``model.safetensors``) into OUTPUT_DIR as DeepSpeed's does for a model under ``--max_shard_size`` (one file
here, whatever the size).
"""

RECOVERY_SCRIPT = """#!/usr/bin/env python
# Written by ds_patrickstar (zero_optimization stage "patrickstar") where DeepSpeed writes its zero_to_fp32.py:
# DeepSpeed's command line, reading this stage's checkpoints (needs ds_patrickstar installed).
#   python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization] [--exclude_frozen_parameters]
import sys

from ds_patrickstar.zero_to_fp32 import deepspeed_main

if __name__ == "__main__":
    sys.exit(deepspeed_main())
"""
