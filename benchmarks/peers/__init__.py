"""Peer engines measured beside mmcache in the prefix benchmark, on the same model folder and dtype.

* ``transformers_cb``: transformers' continuous batching with block sharing, in this process.
* ``vllm_cpu``: vLLM's CPU build with automatic prefix caching, in its own interpreter (``VLLM_PEER_PYTHON``),
  driven by ``vllm_runner.py``.

Both are played through ``protocol.play``, the driver every engine of the benchmark shares. This package's
``__init__`` imports nothing, because ``vllm_runner.py`` imports ``protocol`` from an interpreter without mmcache.
"""
