"""`kvflow bench serve`: load any OpenAI-compatible server over HTTP/SSE and measure it.

`datasets` makes the requests, `client` streams one and times its tokens, `runner` sends them
at a request rate and `monitor` scrapes the server's queue from /metrics meanwhile; `metrics`
summarises, `plots` draws. Nothing here imports torch or kvflow's engine: the same command
measures kvflow and vLLM alike.
"""
