"""``kvroute gateway`` flags, environment fallback and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import config_from_args, main
from gateway.text.tokenizer_folder import resolve_model_dir


def test_flags_build_the_config(smollm2: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"k": "t"}')
    cfg = config_from_args(
        [
            "--model",
            str(smollm2),
            "--served-model-name",
            "smol",
            "--redis-url",
            "redis://r:1/2",
            "--redis-namespace",
            "ns",
            "--port",
            "9000",
            "--policy",
            "prefix",
            "--balance-factor",
            "2.5",
            "--shared-fill-gain",
            "2",
            "--session-ttl",
            "5",
            "--speculative-ttl",
            "0",
            "--max-queue-per-worker",
            "3",
            "--request-timeout",
            "7",
            "--max-body-bytes",
            "5000",
            "--api-keys-file",
            str(keys),
            "--log-level",
            "DEBUG",
        ]
    )
    assert cfg.model_dir == smollm2 and cfg.model_name == "smol"
    assert (cfg.redis_url, cfg.redis_namespace, cfg.port) == ("redis://r:1/2", "ns", 9000)
    assert (cfg.router.policy, cfg.router.balance_factor) == ("prefix", 2.5)
    assert cfg.router.shared_fill_gain == 2.0
    assert (cfg.session_ttl_s, cfg.speculative_ttl_s, cfg.max_queue_per_worker) == (5, 0, 3)
    assert (cfg.request_timeout_s, cfg.max_body_bytes) == (7, 5000)
    assert cfg.api_keys_file == keys and cfg.log_level == "debug"


def test_environment_fallback(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_MODEL", str(smollm2))
    monkeypatch.setenv("KVROUTE_POLICY", "round_robin")
    monkeypatch.setenv("KVROUTE_SPECULATIVE_TTL", "0.5")
    cfg = config_from_args(["--port", "1234"])
    assert (cfg.router.policy, cfg.speculative_ttl_s, cfg.port) == ("round_robin", 0.5, 1234)
    assert cfg.model_name == smollm2.resolve().name
    cfg = config_from_args(["--policy", "random"])  # a flag beats the environment
    assert cfg.router.policy == "random"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--policy", "fastest"], "--policy"),
        (["--balance-factor", "0.5"], "--balance-factor"),
        (["--balance-factor", "lots"], "--balance-factor"),
        (["--shared-fill-gain", "0.5"], "--shared-fill-gain"),
        (["--port", "70000"], "--port"),
        (["--redis-url", "http://x"], "--redis-url"),
        (["--redis-namespace", "a:b"], "--redis-namespace"),
        (["--log-level", "loud"], "--log-level"),
        (["--max-body-bytes", "10"], "--max-body-bytes"),
    ],
)
def test_bad_values_name_the_flag(smollm2: Path, argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        config_from_args(["--model", str(smollm2), *argv])


def test_model_must_exist_and_main_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="--model"):
        resolve_model_dir(str(tmp_path / "nope"))
    assert main(["--model", str(tmp_path / "nope")]) == 2
    assert "--model" in capsys.readouterr().err


def test_smollm2_alias_uses_the_cache_dir(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(smollm2.parent.parent))
    assert resolve_model_dir("smollm2") == smollm2
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="smollm2"):
        resolve_model_dir("smollm2")


def test_grpc_token_file(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "token"
    path.write_text("  tok-0123456789abcdef\n")
    cfg = config_from_args(["--model", str(smollm2), "--grpc-token-file", str(path)])
    assert cfg.grpc_token == "tok-0123456789abcdef"
    assert "tok-0123456789abcdef" not in repr(cfg)
    assert config_from_args(["--model", str(smollm2)]).grpc_token == ""
    path.write_text("")
    with pytest.raises(ValueError, match=r"--grpc-token-file .*empty"):
        config_from_args(["--model", str(smollm2), "--grpc-token-file", str(path)])
    assert main(["--model", str(smollm2), "--grpc-token-file", str(tmp_path / "nope")]) == 2
    assert "--grpc-token-file" in capsys.readouterr().err
