"""An OpenAI-compatible HTTP server over the online engine (`mla-func serve`).

The engine runs on one thread of its own (`engine_loop`), which alone touches it: requests are
added and aborted between its iterations. The HTTP side (`app`, on Starlette under uvicorn) checks
each body (`protocol`), hands the request to that thread and streams its events back (`request_stream`,
`responses`); `metrics` exposes the engine's load and latencies in Prometheus' text format.
"""
