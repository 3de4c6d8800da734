"""Workloads, trace replay, the fleet simulator and benchmarks that prove kvroute's claims."""
