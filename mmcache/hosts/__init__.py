"""The hosts: the reference engine composed with the encoders.

``vlm`` is the VLM front end (``VLMEngine``): chat messages with images in, an ``Engine`` whose prompts carry the
images' features out. A layer above the core, the engine and the encoders, and below the HTTP server
(``mmcache.server``), which may import it; nothing here imports the server, the presets or a command line.
"""
