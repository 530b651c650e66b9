"""The frontend: OpenAI REST + gRPC on one asyncio loop; validates, applies the chat
template, tokenizes, routes each request to a decode worker (and a prefill worker)
and relays the tokens.  Never imports torch.

    config.py      flags -> FrontendConfig
    protocol.py    OpenAI request bodies (types)       prepare.py   -> validated Plan
    tokenizer.py   tokenizers + jinja2 chat template   errors.py    the one error mapping
    worker_pool.py worker channels, Info, WatchLoad    router.py    Router protocol, LoadRouter
    dispatch.py    worker calls, retry, fan-out        request_run.py  one request in flight
    results.py     events, choices and usage           openai_format.py  responses, SSE chunks
    rest.py        FastAPI routes                      grpc_service.py   Frontend.Generate
    core.py        the parts wired together            app.py       serve(): one loop, graceful stop
    auth.py        API keys, tenants, cache salts      model_files.py  the model's tokenizer and config

Of the engine it imports only the torch-free vocabulary, engine/vocab/
(docs/ARCHITECTURE.md).
"""
