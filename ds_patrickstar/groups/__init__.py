"""Chunk groups and the chunk manager that drives them through training: the core runtime, also at
world size 1, where every collective is a no-op and the same code runs.

Owns the collectives on DeepSpeed's data-parallel group (``comm.py``), one chunk group's members,
gather, release, reduce-scatter and state (``group.py``), which groups are gathered and the
all-gathers, prefetches and releases that change it (``residency.py``), the gather order
(``gather_order.py``), the gather plan the ranks agree on under placement (``gather_plan.py``), the
keep policy (``keep.py``), a group's joined buffers of straddling tensors (``straddle.py``), the
gradient sink with its reduce-scatters (``grads.py``; those in flight are ``memory/reductions.py``'s;
the flat gradient buffers they read: ``flat.py``; with gradient accumulation, the micro-steps'
reduce-scatters into owned accumulators: ``accumulation.py``) and the facade the hooks and the
optimizer call (``manager.py``); what the ranks agree on, lockstep checks and agreed values, on a gloo group
of its own (``agreement.py``; the message when ranks diverge: ``lockstep.py``).
May import: ``activations``, ``placement``, ``store``, ``disk``, ``memory``, ``chunks`` and the leaf
modules.
"""
