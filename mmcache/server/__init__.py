"""``mmcache serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the reference engine.

A host layer above the engine and the encoders: it may import the core, ``mmcache.engine``, ``encoders`` and
``mmcache.hosts``; the presets (``mmcache.presets.serving`` builds what a config names), the command line,
benchmarks and tests import it. It serves built models and never builds a preset itself. The pieces, one concept each:

* serving in general: ``config`` (what to serve and its limits), ``intake`` (the checks every route shares:
  key, body size, JSON, model, salt), ``tenants`` (API keys and cache salts), ``errors`` (OpenAI error
  objects), ``metrics`` (Prometheus), ``app`` (the app assembled), ``launch`` (``start_server``), ``cli``
  (``mmcache serve``);
* chat: ``chat`` (``/v1/chat/completions`` and ``/v1/completions``, whole and streamed), ``engine_host`` (the
  engine's step loop in its own thread, asyncio queues to handlers), ``protocol`` (request and response
  bodies), ``prompts`` (API requests to engine requests), ``text_output`` (events to text, stop strings);
* generation: ``job_queue`` (one bounded queue and worker thread per pipeline, the images', speech's and video
  jobs' alike), ``images`` (``/v1/images/generations``), ``speech`` (``/v1/audio/speech``), ``videos``,
  ``video_jobs``, ``video_render``, ``video_mp4`` (``/v1/videos``: asynchronous jobs, their bounded store,
  rendering and MP4 encoding).

    from mmcache.presets import serve

    with serve(ServerConfig(preset="tiny-llava")) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
"""

from .config import ServerConfig, ServerConfigError
from .launch import Models, RunningServer, start_server

__all__ = ["Models", "RunningServer", "ServerConfig", "ServerConfigError", "start_server"]
