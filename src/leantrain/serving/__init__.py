"""Serving: a verified semantic cache (`cache`, `policy`, `store`, `embedding`, `server`,
`backends`, the labelled `evalset`) and stochastic KV routing (`kv_routing`).

Nothing is imported here: the cache needs the `serve` extras (faiss, sentence-transformers,
fastapi), KV routing needs none of them.
"""
