"""AutoCache: the frozen prefix's activations, kept so later epochs skip recomputing them.

One package, modules on different floors (``tests/test_layering.py`` checks each against its
own):

* ``policy.py``: when the cache turns on, the one place that decides it (pure);
* ``size.py``: how much it may hold (pure);
* ``store.py``: the store seam and its block bookkeeping (numpy and torch);
* ``rows.py``: the tiers beside stage 0, rows in preallocated tensors (torch);
* ``prefix.py``: stage 0's frozen prefix served from the store and the tiers (torch);
* ``owners.py``: the store in Ray's object store, one owner actor per node (Ray).

This file imports nothing, so the pure modules load without torch or Ray.
"""
