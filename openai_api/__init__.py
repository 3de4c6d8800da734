"""The OpenAI API as every kvroute HTTP front speaks it (the gateway's edge and a worker's own
front): request parsing and validation, response and stream-chunk shapes, OpenAI-shaped errors,
and streaming detokenization with stop strings. Light: no torch, no aiohttp, no tokenizer
loading, so both sides import it and can never disagree on what a request means."""
