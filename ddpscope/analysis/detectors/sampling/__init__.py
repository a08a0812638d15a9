"""Sampler mistakes: a forgotten ``set_epoch``, unsharded or overlapping data, uneven inputs.

One module per detector (set_epoch, sharding, uneven), all three judging
from the pass ledger (ledger.py): which pass of its loader each step drew from.
"""
