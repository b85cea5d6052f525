"""The OpenAI-compatible HTTP API of the frontend process (aiohttp, on the frontend's event loop).

    api_server.py    routes, middlewares, lifecycle (`ApiServer`, started by zllm/launch)
    serving.py       OpenAI requests -> engine requests -> OpenAI responses and SSE chunks
    protocol.py      msgspec request/response Structs and the OpenAPI document
    constraints.py   response_format / structured_outputs / guided_* / tool_choice -> StructuredOutputsParams
    tool_parsers.py  tool calls read out of generated text, whole or streamed (--tool-call-parser)
    reasoning_parsers.py  a reasoning model's thinking apart from its answer (--reasoning-parser)
    responses*.py    /v1/responses (OpenAI's Responses API) as a chat completion, its events, its store
    messages_*.py    /v1/messages (Anthropic's Messages API) as a chat completion
    batch.py         OpenAI batch files, line by line through the same calls (vllm-launch run-batch)

It is a client of the frontend, not part of its core: its requests and calls reach the engines
only through `FrontendServer`'s local-client calls (`open_local_client` / `submit` /
`close_local_client`); beside those it reads the server's state (config, tokenizer, metrics,
health) and uses the frontend's helpers (chat template, best_of ranking). Nothing else in the
frontend imports it: the launcher (zllm/launch/service.py) builds the `ApiServer` over the server.
"""
