"""Sampling options end to end: the ``openai`` SDK against a real gateway and a real worker
process on tiny_llama (gRPC between them), checked against Hugging Face on the same weights.

logprobs equal ``log_softmax`` of HF's logits for the chosen tokens (chat and completions,
streamed and not, and the worker's own HTTP front agrees); penalties and ``logit_bias``
change greedy output exactly as an HF loop applying the same rule does.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.gateway.pair import Pair, serve_pair

pytestmark = pytest.mark.slow
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]


@pytest.fixture(scope="module")
def pair(
    tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    with serve_pair(tiny_llama, redis_url, tmp_path_factory.mktemp("options-logs")) as p:
        yield p


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _hf_steps(hf: Any, prompt: list[int], n: int, rule: Any = None) -> tuple[list[int], list[Any]]:
    """Greedy decoding on HF, optionally through ``rule(logits, generated)``; raw log-softmax."""
    ids = list(prompt)
    logps = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            logps.append(torch.log_softmax(logits, -1))
            chosen = logits if rule is None else rule(logits.clone(), ids[len(prompt) :])
            ids.append(int(chosen.argmax()))
    return ids[len(prompt) :], logps


def test_completion_logprobs_equal_hf_log_softmax(pair: Pair, hf: Any) -> None:
    tokens, logps = _hf_steps(hf, PROMPT, 6)
    for client in (pair.client(), pair.worker_client()):
        out = client.completions.create(
            model=pair.name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        lp = out.choices[0].logprobs
        assert lp is not None and len(lp.token_logprobs) == 6
        for i, (token, value) in enumerate(zip(tokens, lp.token_logprobs, strict=True)):
            assert abs(value - float(logps[i][token])) < 1e-3, (i, value)
            top = lp.top_logprobs[i]
            assert len(top) == 3 and abs(max(top.values()) - float(logps[i].max())) < 1e-3
        assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs_streamed_equal_unstreamed(pair: Pair) -> None:
    client = pair.client()
    args: dict[str, Any] = dict(
        model=pair.name, messages=[{"role": "user", "content": "Count to five"}],
        max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    # The streamed run reads the first one's cached blocks, so its float sums run in a
    # different order: the same tokens, log-probabilities equal to ~1e-5.
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-3)
    assert "".join(c.token for c in content) == whole.choices[0].message.content


def test_penalties_and_logit_bias_change_greedy_output_as_specified(pair: Pair, hf: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair.model_dir)
    client = pair.client()

    def text(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    def complete(**options: Any) -> str:
        out = client.completions.create(
            model=pair.name, prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, **options.pop("extra", {})}, **options,
        )  # fmt: skip
        return out.choices[0].text

    def counted(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        for t in set(generated):
            logits[t] -= 0.7 * generated.count(t) + 0.5
        return logits

    def repeated(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        seen = torch.tensor(sorted(set(PROMPT + generated)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / 1.8, vals * 1.8)
        return logits

    def banned(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        logits[plain[0]] -= 100
        return logits

    plain, _ = _hf_steps(hf, PROMPT, 8)
    for rule, options in (
        (counted, {"frequency_penalty": 0.7, "presence_penalty": 0.5}),
        (repeated, {"extra": {"repetition_penalty": 1.8}}),
        (banned, {"logit_bias": {str(plain[0]): -100}}),
    ):
        expected, _ = _hf_steps(hf, PROMPT, 8, rule)
        assert expected != plain, options  # the option matters on this prompt
        assert complete(**options) == text(expected), options


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_n_choices_share_the_prompt_blocks(pair: Pair) -> None:
    worker_url = f"http://127.0.0.1:{pair.worker.extra['http_port']}"
    prompt = [7 + (i * 37) % 4000 for i in range(70)]  # 4 full blocks of 16, never seen
    before = _metric(worker_url, "kvroute_worker_cached_prompt_tokens_total")
    out = pair.client().completions.create(
        model=pair.name, prompt=prompt, max_tokens=6, n=3, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == 70 and out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1  # seeds differ per choice
    # The first choice computed the prompt; the other two found its 4 full blocks cached.
    after = _metric(worker_url, "kvroute_worker_cached_prompt_tokens_total")
    assert after - before == 2 * 64


def test_response_format_json_schema_through_the_gateway(pair: Pair) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    # 20 different prompts (issue 15's acceptance), sampled at temperature 1: the random
    # weights would wander anywhere, so every valid answer is the grammar's doing.
    for n in range(20):
        out = pair.client().chat.completions.create(
            model=pair.name,
            messages=[
                {"role": "user", "content": f"Question {n}: answer in JSON, {'please ' * n}"}
            ],
            max_tokens=48,
            temperature=1.0,
            seed=n,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        )
        content = out.choices[0].message.content or ""
        assert out.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), schema)
