"""A kvroute worker: paged-KV prefix-caching engine, gRPC + HTTP servers, Redis publisher."""
