"""Announcing the worker in Redis: registry heartbeat, block set and event stream."""
