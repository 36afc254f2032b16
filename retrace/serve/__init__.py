"""`retrace serve`: an OpenAI-compatible HTTP server on the engine (retrace/runtime/serving_engine.py).

app.py (routes, SSE), schemas.py (request bodies, OpenAI error bodies), chat.py (the tokenizer's chat
template), cli.py (the command). Needs the `serve` extra (fastapi, uvicorn, prometheus-client).
"""
