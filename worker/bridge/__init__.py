"""The bridge that brings workers of other engines (vLLM first) into a kvroute fleet."""
