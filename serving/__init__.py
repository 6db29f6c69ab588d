"""serving: makes adaptive-eagle a service. A Ray-free `DecodeServer` around a backend (the reference
engine, or SGLang on GPUs), a thin Ray actor around it, the OpenAI-compatible gateway (FastAPI),
capture into the feature store, Prometheus metrics, and the hot-swap entry point
`swap_head(version) -> SwapResult`."""
