"""``kvroute worker``: builds the engine, servers and publisher from flags, runs until signalled.

Startup: resolve the model folder → model runner → engine thread → (pinned
system prompt) → gRPC server → HTTP front → Redis publisher. Redis being
unreachable does not stop the worker from serving; the publisher keeps
retrying. SIGTERM/SIGINT stop it gracefully: deregister from Redis first (so
gateways stop routing here), then drain both servers at once, letting
in-flight requests finish for up to ``--drain-grace-s`` (the pod's
termination grace), then stop the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contract.hashing import HashSpec
from contract.prompt_wire import PROMPT_LE32
from contract.redis_layout import WorkerRecord
from worker.engine.torch_thread import TorchThread
from worker.serve.config import WorkerConfig, config_from_args

logger = logging.getLogger(__name__)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def system_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids a chat request with this system prompt starts with.

    Rendered through the chat template as a lone system message, so the pinned
    blocks are the ones real chat requests reuse; templates without a system
    role fall back to the raw text.
    """
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": text}], tokenize=False, add_generation_prompt=False
        )
    except Exception as exc:  # a template may raise anything for an unsupported role
        logger.warning("chat template cannot render a system message (%s); pinning raw text", exc)
        return list(tokenizer.encode(text, add_special_tokens=True))
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))


class WorkerProcess:
    """The running pieces of one worker, so they can be stopped in order."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine: Any = None
        self.publisher: Any = None
        self.grpc_server: Any = None
        self.grpc_service: Any = None  # the WorkerService, once started
        self.http_runner: Any = None
        self.grpc_port = 0
        self.http_port = 0
        self.frames_server: Any = None

    async def start(self) -> None:
        """Loads the model and starts every component; raises if a port cannot be bound."""
        from worker.engine.thread import Engine, EngineConfig
        from worker.model.store import resolve_model
        from worker.publish.event_queue import EventQueue
        from worker.publish.publisher import Publisher, PublisherConfig
        from worker.serve.grpc_server import WorkerService, start_grpc_server
        from worker.serve.metrics import WorkerMetrics

        cfg = self.config
        model_dir = await asyncio.to_thread(resolve_model, cfg.model)
        tokenizer = None
        if cfg.http_port or cfg.pin_system_prompt is not None or cfg.engine == "emulated":
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
        sampler = None
        torch_thread: TorchThread | None = None
        if cfg.engine == "emulated":
            from worker.model import emulated

            runner: Any = emulated.EmulatedRunner(
                emulated.load_profile(cfg.profile),
                model_dir,
                block_size=cfg.block_size,
                num_blocks=cfg.num_blocks,
                output_token_ids=emulated.output_token_ids(tokenizer),
                time_scale=cfg.emulated_time_scale,
            )
            sampler = emulated.EmulatedSampler()
        else:
            from worker.model.runner import ModelRunner

            # Loaded on the thread that will step it (worker.engine.torch_thread).
            torch_thread = TorchThread()
            runner = await torch_thread.run(
                ModelRunner,
                model_dir,
                device=cfg.device,
                dtype=cfg.dtype,
                block_size=cfg.block_size,
                num_blocks=cfg.num_blocks,
                memory_fraction=cfg.memory_fraction,
                kv_cache_dtype=cfg.kv_cache_dtype,
            )
            if runner.device.type == "cpu":
                from worker.model.host_memory import keep_freed_heap

                keep_freed_heap()
            warmed = await torch_thread.run(runner.warm_up, cfg.max_batch_tokens)
            logger.info("warm-up prefill of %d tokens done", warmed)
        spec = HashSpec(block_size=cfg.block_size, model=cfg.served_model_name)
        events = EventQueue()
        engine_config = EngineConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_batch_tokens=cfg.max_batch_tokens,
            max_model_len=cfg.max_model_len,
        )
        self.engine = Engine(
            runner,
            engine_config,
            hash_spec=spec,
            on_events=events.put,
            sampler=sampler,
            stream_interval=cfg.stream_interval,
        )
        if cfg.engine != "emulated":
            from worker.model.logits_processors import Grammars

            self.engine.grammars = Grammars(model_dir)  # response_format, built on first use
        self.engine.start(on=torch_thread)
        metrics = WorkerMetrics(
            self.engine, cfg.worker_id, cfg.served_model_name if cfg.vllm_metrics else None
        )
        self.publisher = Publisher(
            self.engine,
            events,
            PublisherConfig(
                redis_url=cfg.redis_url,
                worker_id=cfg.worker_id,
                namespace=cfg.redis_namespace,
                cluster=cfg.redis_cluster,
                heartbeat_interval=cfg.heartbeat_interval,
                heartbeat_ttl=cfg.heartbeat_ttl,
            ),
            WorkerRecord(
                worker_id=cfg.worker_id,
                address="",
                model=cfg.served_model_name,
                hash_spec=spec.describe(),
                block_size=cfg.block_size,
                num_blocks=self.engine.num_blocks,
                max_model_len=self.engine.max_model_len,
            ),
        )

        if cfg.pin_system_prompt is not None:
            await self._pin(tokenizer, cfg.pin_system_prompt)

        service = WorkerService(self.engine, worker_id=cfg.worker_id, stall_s=cfg.engine_stall_s)
        self.grpc_service = service
        self.grpc_server, self.grpc_port = await start_grpc_server(
            service,
            cfg.host,
            cfg.grpc_port,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            token=cfg.grpc_token,
        )
        frames_address = ""
        if cfg.frames_port:
            from worker.serve.frames_server import FramesServer

            self.frames_server = FramesServer(
                service, metrics.frames_connections.labels(cfg.worker_id).inc
            )
            bound = await self.frames_server.start(cfg.host, cfg.frames_port)
            frames_address = _host_port(cfg.advertised_host, bound)
        http_address = ""
        if cfg.http_port:
            from worker.serve.http_server import create_app, start_http_server

            app = create_app(
                self.engine,
                tokenizer,
                model_name=cfg.served_model_name,
                worker_id=cfg.worker_id,
                metrics=metrics,
                trust_body_salt=cfg.trust_body_salt,
                stall_s=cfg.engine_stall_s,
                token=cfg.grpc_token,
            )
            self.http_runner, self.http_port = await start_http_server(
                app, cfg.host, cfg.http_port, shutdown_timeout_s=cfg.drain_grace_s
            )
            http_address = _host_port(cfg.advertised_host, self.http_port)
        self.publisher.update_record(
            address=_host_port(cfg.advertised_host, self.grpc_port),
            http_address=http_address,
            frames_address=frames_address,
            prompt_encoding=PROMPT_LE32,
        )
        await self.publisher.start()
        logger.info(
            "worker %s serving %s (%d blocks of %d tokens): grpc_port=%d http_port=%d frames=%s%s",
            cfg.worker_id,
            cfg.served_model_name,
            self.engine.num_blocks,
            cfg.block_size,
            self.grpc_port,
            self.http_port,
            frames_address or "off",
            " (token required)" if cfg.grpc_token else "",
        )

    async def _pin(self, tokenizer: Any, path: Path) -> None:
        text = path.read_text(encoding="utf-8")
        ids = system_prompt_ids(tokenizer, text)
        pinned = await asyncio.to_thread(self.engine.pin_prefix, ids)
        logger.info("pinned %d blocks of the system prompt in %s", pinned, path)

    async def stop(self) -> None:
        """Deregisters, drains the servers, stops the engine; safe after a partial start."""
        if self.publisher is not None:
            await self.publisher.stop(deregister=True)
        # New calls are refused from here on (gateways retry them elsewhere before
        # their first token); calls in flight run to completion within the grace.
        drains = []
        if self.grpc_service is not None:
            # A gateway's GenerateMany stream outlives the server's refusal of new
            # calls: the service refuses the new calls framed on it instead.
            self.grpc_service.draining = True
        if self.grpc_server is not None:
            drains.append(self.grpc_server.stop(self.config.drain_grace_s))
        if self.frames_server is not None:
            drains.append(self.frames_server.stop(self.config.drain_grace_s))
        if self.http_runner is not None:
            drains.append(self.http_runner.cleanup())
        if drains:
            logger.info(
                "worker %s draining (up to %.0f s)",
                self.config.worker_id,
                self.config.drain_grace_s,
            )
            await asyncio.gather(*drains)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        logger.info("worker %s stopped", self.config.worker_id)


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    """Runs a worker until ``stop`` is set or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            logger.debug("cannot install a handler for %s", sig)
    worker = WorkerProcess(config)
    try:
        await worker.start()
        await stop.wait()
        logger.info("worker %s stopping", config.worker_id)
    finally:
        await worker.stop()


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute worker [flags]``; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        logger.error("kvroute worker: %s", exc)
        return 2
    logging.getLogger().setLevel(config.log_level)
    from openai_api.server_log import redact_parser_errors

    redact_parser_errors()  # as the gateway: no request bytes of a refused header in the log
    if config.engine == "emulated" and "torch" not in sys.modules:
        # An emulated worker needs only its tokenizer: keep transformers from
        # importing torch (~250 MB a process), so dozens of workers fit one host.
        sys.modules["torch"] = None  # type: ignore[assignment]
    elif config.device == "cpu":
        from worker.model.host_memory import one_malloc_arena

        one_malloc_arena()  # before the engine's thread exists (worker.model.host_memory)
    try:
        _run(serve(config))
    except (OSError, ValueError, FileNotFoundError) as exc:
        logger.error("kvroute worker %s failed to start: %s", config.worker_id, exc)
        return 1
    return 0
