"""The optimizer: one Adam math, several backends, torch's SGD, and the states they update.

Owns the pure-torch reference math (``adam_math.py``, also the oracle of the kernels), the JIT
kernels and their loader (``kernels.py``, sources in ``ops/``), torch's SGD on chunks
(``sgd_math.py``), which update a client's optimizer asks for (``rules.py``), the fp32
master/momentum/variance of the owned chunks and where they live (``states.py``), the per-chunk
dispatch of hybrid Adam (``chunk_adam.py``) and the parameters frozen after initialize
(``frozen_steps.py``).
May import: ``placement``, ``store``, ``disk``, ``memory``, ``chunks`` and the leaf modules (not
``groups``: it updates the chunks a rank owns, whatever the collectives did). It imports no placement
code: the step's driver places each chunk for its update (see [Note: placement planner]).
"""
