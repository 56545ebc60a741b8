"""Chunks: the model-data layout and its bookkeeping, with no memory of its own.

Owns the kinds of chunk, trainable and frozen (``kind.py``), the tensor state machine
(``state.py``), chunks and per-parameter metadata (``chunk.py``), the
layout plan that decides which parameter goes where before anything is allocated (``layout.py``),
what one chunk group takes on the accelerator (``group_bytes.py``), and the chunk map that answers
"which chunk, which group, whose" (``chunk_map.py``).
May import: torch only (the bottom layer).
"""
