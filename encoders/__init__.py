"""Adapters that route real encoders' outputs through the encoder-output store (``mmcache.store``).

Each adapter module names the models it serves and states its own invariants. Optional dependencies (diffusers)
are imported inside the functions that need them, so ``import encoders`` works without them.
"""
