"""Fixtures of the worker tests: a whole worker in-process (``tests/worker/server_stack.py``)."""

from tests.worker.server_stack import stack, stack_runner, stack_tokenizer  # noqa: F401 (fixtures)
