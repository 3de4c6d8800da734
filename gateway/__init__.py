"""The kvroute gateway: OpenAI API in, cache-aware routing, gRPC to workers. Never imports torch."""
