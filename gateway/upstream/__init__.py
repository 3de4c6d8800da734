"""Clients of the workers: gRPC for kvroute's engine (and OpenAI HTTP for vLLM workers)."""
