"""The HTTP edge: the aiohttp app, OpenAI endpoints, API keys, OpenAI-shaped errors, the OpenAPI document."""
