"""``WorkerConfig`` from flags with ``KVROUTE_*`` env fallback, and its validation."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from worker.serve.config import config_from_args, env_name


def test_flags_win_over_env_and_env_over_defaults(tmp_path: Path) -> None:
    env = {
        "KVROUTE_REDIS_URL": "redis://:pw@redis:6380/2",
        "KVROUTE_GRPC_PORT": "7000",
        "KVROUTE_BLOCK_SIZE": "32",
    }
    cfg = config_from_args(
        ["--model", str(tmp_path), "--grpc-port", "7001", "--dtype", "bf16"], env
    )
    assert cfg.redis_url == "redis://:pw@redis:6380/2"
    assert (cfg.grpc_port, cfg.block_size, cfg.dtype) == (7001, 32, "bfloat16")
    assert cfg.served_model_name == tmp_path.name  # the folder name is the default
    assert cfg.worker_id.endswith(f"-{os.getpid()}")
    assert (cfg.http_port, cfg.heartbeat_interval, cfg.heartbeat_ttl) == (8001, 1.0, 3.0)
    assert cfg.stream_interval == 1  # every step's tokens go out as they come
    assert config_from_args(["--model", "m"], {"KVROUTE_STREAM_INTERVAL": "4"}).stream_interval == 4
    assert env_name("--pin-system-prompt") == "KVROUTE_PIN_SYSTEM_PROMPT"


def test_alias_and_gguf_names() -> None:
    assert config_from_args(["--model", "smollm2"], {}).served_model_name == (
        "SmolLM2-135M-Instruct"
    )
    assert config_from_args(["--model", "/m/q4.gguf"], {}).served_model_name == "q4"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--model"),
        (["--grpc-port", "70000"], "--grpc-port"),
        (["--grpc-port", "x"], "--grpc-port"),
        (["--heartbeat-ttl", "0.5"], "--heartbeat-ttl"),
        (["--redis-url", "http://x"], "--redis-url"),
        (["--redis-namespace", "a:b"], "--redis-namespace"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["--device", "tpu"], "--device"),
        (["--memory-fraction", "1.5"], "--memory-fraction"),
        (["--tls-cert", "/nope.pem"], "--tls-cert"),
        (["--pin-system-prompt", "/nope.txt"], "--pin-system-prompt"),
        (["--block-size", "0"], "--block-size"),
        (["--stream-interval", "0"], "--stream-interval"),
        (["--frames-port", "70000"], "--frames-port"),
        (["--frames-port", "50051"], "--frames-port"),  # the gRPC port's default
    ],
)
def test_bad_values_name_the_flag(argv: list[str], flag: str) -> None:
    base = [] if not argv else ["--model", "m"]
    with pytest.raises(ValueError, match=flag):
        config_from_args(base + argv, {})


def test_bad_env_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--num-blocks"):
        config_from_args(["--model", "m"], {"KVROUTE_NUM_BLOCKS": "lots"})


def test_advertised_host() -> None:
    base = ["--model", "m"]
    assert config_from_args([*base, "--host", "127.0.0.1"], {}).advertised_host == "127.0.0.1"
    explicit = config_from_args([*base, "--advertise-host", "pod-3.svc"], {})
    assert explicit.advertised_host == "pod-3.svc"
    wildcard = config_from_args(base, {}).advertised_host  # --host defaults to 0.0.0.0
    assert wildcard not in ("", "0.0.0.0") and socket.gethostbyname(wildcard) == wildcard


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read"),
        ("", "empty"),
        ("\n  \n", "empty"),
        ("short-token", "at least 16"),
        ("a token with spaces inside", "printable ASCII"),
    ],
)
def test_grpc_token_file_problems_stop_the_start(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"--grpc-token-file.*{reason}"):
        config_from_args(["--model", "m", "--grpc-token-file", str(path)], {})


def test_grpc_token_is_read_once_stripped_and_kept_out_of_repr(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("tok-0123456789abcdef\n")
    cfg = config_from_args(["--model", "m"], {"KVROUTE_GRPC_TOKEN_FILE": str(path)})
    path.unlink()  # read at parse time: nothing later depends on the file
    assert cfg.grpc_token == "tok-0123456789abcdef"
    assert "tok-0123456789abcdef" not in repr(cfg)
    assert config_from_args(["--model", "m"], {}).grpc_token == ""


def test_the_frames_port_is_refused_beside_a_token_or_tls(tmp_path: Path) -> None:
    # The frames port checks neither: a secured worker must not open it.
    token = tmp_path / "token"
    token.write_text("tok-0123456789abcdef\n")
    with pytest.raises(ValueError, match=r"--frames-port.*neither TLS nor a token"):
        config_from_args(
            ["--model", "m", "--frames-port", "50061", "--grpc-token-file", str(token)], {}
        )
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    with pytest.raises(ValueError, match="--frames-port"):
        config_from_args(
            [
                "--model",
                "m",
                "--frames-port",
                "50061",
                "--tls-cert",
                str(cert),
                "--tls-key",
                str(key),
            ],
            {},
        )
    assert config_from_args(["--model", "m", "--frames-port", "50061"], {}).frames_port == 50061
    assert config_from_args(["--model", "m"], {}).frames_port == 0  # off unless asked for
