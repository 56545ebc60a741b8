"""Data parallel, and the chunk manager that drives chunk groups through training.

Owns the collectives on DeepSpeed's data-parallel group (``comm.py``), which groups are gathered
and the all-gathers, prefetches and releases that change it (``groups.py``), the gather order
(``gather_order.py``), the gather plan the ranks agree on under placement (``gather_plan.py``), the
keep policy (``keep.py``), straddling tensors' joined buffers (``straddle.py``), the gradient
sink with its reduce-scatters (``grads.py``, ``reductions.py``, the flat gradient buffers they
read: ``flat.py``; with gradient accumulation, the micro-steps' reduce-scatters into owned
accumulators: ``accumulation.py``)
and the facade the hooks and the optimizer call (``manager.py``). With one rank every collective
is a no-op and the same code runs.
May import: ``placement``, ``memory``, ``chunks`` and the leaf modules.
"""
