"""Model data in and out: checkpoints, state dicts, deferred initialization, pretrained weights.

Owns the checkpoint format (``checkpoint.py``) and the commit of a save (``commit.py``), streaming
chunk values to and from the host for ``state_dict``/``load_state_dict`` (``export.py``),
``ds_patrickstar.Init`` (``init.py``) and ``load_pretrained`` (``pretrained.py``).
May import: ``disk``, ``optim``, ``groups``, ``activations``, ``placement``, ``memory``, ``chunks`` and
the leaf modules.
"""
