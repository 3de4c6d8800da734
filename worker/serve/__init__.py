"""Serving one engine: gRPC and OpenAI HTTP fronts, Prometheus metrics, configuration and the CLI."""
