"""`fuselm serve`: an OpenAI-compatible HTTP server over one loaded model.

    import fuselm
    from fuselm.server import create_app
    app = create_app(fuselm.load())       # an ASGI app: run it with uvicorn

Modules: `schemas` (request and response bodies), `jobs` (a request checked and turned into a
generation job), `scheduler` (the waiting queue and the worker thread that owns the model),
`stops` (stop strings), `replies` (OpenAI's response and chunk objects), `errors` (OpenAI-style
error bodies), `metrics` (Prometheus), `app` (routes), `cli` (the `fuselm serve` command).
"""
from .app import create_app

__all__ = ["create_app"]
