"""Activation offload: saved tensors and held inputs of the model's blocks to pinned host memory
and back (``zero_optimization.offload_activations``).

Owns the offloader with its segments and saved-tensor hooks (``offloader.py``), the copies of
one storage to the host and back (``copies.py``), the blocks' held inputs (``held.py``), what it
keeps per storage (``storages.py``: entries, segments, held inputs and their states) and which
blocks ``"auto"`` offloads (``plan.py``). Placement reaches it through the ``ActivationPolicy`` protocol of
``placement/runtime.py``.
May import: ``placement``, ``memory``, ``chunks`` and the leaf modules.
"""
