"""KVTierConnector names every input that changes a request's KV, and reaches a server that asks
for credentials. vLLM's real Request and Scheduler (vllm_harness.py), a real `kvtier serve`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.servers import ServerProcess, free_port, start_server
from testkit.tiny_models import write_lora_adapter, write_tiny_llama
from testkit.vllm_harness import Harness

from kvtier.errors import InvalidArgumentError

pytestmark = pytest.mark.vllm

CHUNK = 64
PROMPT = [(i * 31) % 500 + 3 for i in range(300)]  # 4 full chunks and a tail
TOKEN = "connector-credential-0123456789"


def _request(request_id: str = "r", **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        **kw,
    )


def _image(identifier: str | None, offset: int, length: int = 16) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,  # type: ignore[arg-type]
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def _run(h: Harness, request_id: str, **kw: Any) -> int:
    """Run one request to its end; the tokens it did not compute (kvtier's hit)."""
    h.add(request_id, PROMPT, **kw)
    h.run_until_done([request_id])
    h.flush()
    return h.num_cached[request_id]


# -- the extra key, from vLLM's own Request objects ---------------------------------------------


def test_each_input_that_changes_the_kv_changes_the_extra_key(tmp_path: Path) -> None:
    import torch
    from vllm.lora.request import LoRARequest

    from kvtier.integrations.vllm.inputs import (
        AdapterFingerprints,
        RequestInputs,
        extra_key,
        request_extra_key,
    )

    model = write_tiny_llama(tmp_path / "m")
    a = write_lora_adapter(tmp_path / "a", model, seed=1)
    b = write_lora_adapter(tmp_path / "b", model, seed=2)
    fps = AdapterFingerprints()

    def key(**kw: Any) -> bytes | None:
        return request_extra_key(_request(**kw), fps)

    plain = key()
    assert plain == b""  # plain token prompts keep the names they always had
    keys = [
        key(lora_request=LoRARequest("a", 1, str(a))),
        key(lora_request=LoRARequest("b", 2, str(b))),
        key(lora_request=LoRARequest("b", 3, str(a))),  # a's files under another name
        key(mm_features=[_image("img-1", 8)]),
        key(mm_features=[_image("img-2", 8)]),
        key(mm_features=[_image("img-1", 40)]),  # the same image elsewhere
        key(mm_features=[_image("img-1", 8, 32)]),
        key(mm_features=[_image("img-1", 8), _image("img-2", 40)]),
        key(prompt_embeds=torch.ones(300, 8)),
        key(prompt_embeds=torch.ones(300, 8) * 2),
        key(lora_request=LoRARequest("a", 1, str(a)), mm_features=[_image("img-1", 8)]),
    ]
    assert all(isinstance(k, bytes) and 0 < len(k) <= 256 for k in keys)
    assert len(set(keys)) == len(keys), "two different inputs got one extra key"
    # stable: the same inputs in another process, another request, give the same key
    assert key(mm_features=[_image("img-1", 8)]) == keys[3]
    assert (
        request_extra_key(_request(lora_request=LoRARequest("a", 1, str(a))), AdapterFingerprints())
        == keys[0]
    )
    # the encoding is structured: no choice of names spells another's parts
    assert extra_key(RequestInputs(lora=("a:b", "c"))) != extra_key(
        RequestInputs(lora=("a", "b:c"))
    )
    # new weights at the adapter's path: a new key for an engine that loads them
    write_lora_adapter(a, model, seed=5)
    assert (
        request_extra_key(_request(lora_request=LoRARequest("a", 1, str(a))), AdapterFingerprints())
        != keys[0]
    )


def test_inputs_the_connector_cannot_name_make_the_request_uncacheable(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from kvtier.integrations.vllm.inputs import AdapterFingerprints, request_extra_key

    fps = AdapterFingerprints()
    absent = LoRARequest("gone", 1, str(tmp_path / "not-here"))
    assert request_extra_key(_request(lora_request=absent), fps) is None
    assert request_extra_key(_request(mm_features=[_image(None, 8)]), fps) is None


# -- the scheduler: uncacheable requests get no hit and save nothing -----------------------------


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server("--l1-size", "64MiB", "--chunk-size", str(CHUNK), "--client-timeout", "5")
    yield srv
    srv.close()


def test_adapter_requests_get_their_own_chunks_and_unnamed_ones_none(
    server: ServerProcess, harness: Callable[..., Harness], tmp_path: Path, model_dir: Path
) -> None:
    from vllm.lora.request import LoRARequest

    adapter = write_lora_adapter(tmp_path / "a", model_dir, seed=1)
    lora = LoRARequest("a", 1, str(adapter))
    absent = LoRARequest("gone", 2, str(tmp_path / "not-here"))
    first = harness(server.address)
    assert _run(first, "base") == 0
    assert _run(first, "gone", lora_request=absent) == 0  # never the base's chunks
    assert _run(first, "adapter", lora_request=lora) == 0  # nor for a named adapter
    first.close()
    second = harness(server.address)  # a new engine: vLLM's own prefix cache is empty
    assert _run(second, "adapter", lora_request=lora) == 256  # its own chunks
    assert _run(second, "gone", lora_request=absent) == 0  # nothing stored, nothing found
    # (multimodal requests need an encoder this text-only scheduler lacks: their key is
    # checked above, on vLLM's Request)


# -- credentials ---------------------------------------------------------------------------------


@pytest.fixture
def authed(tmp_path: Path) -> Iterator[str]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} vllm-tenant\n")
    port = free_port()
    srv = start_server(
        "--l1-size", "64MiB", "--chunk-size", str(CHUNK), "--auth-tokens-file", str(tokens),
        address=f"tcp://0.0.0.0:{port}",
    )  # fmt: skip
    yield f"tcp://127.0.0.1:{port}"
    srv.close()


def test_token_and_token_file_reach_a_server_with_an_auth_tokens_file(
    authed: str, harness: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "credential"
    token_file.write_text(TOKEN + "\n")
    writer = harness(authed, extra={"token": TOKEN})
    assert _run(writer, "a") == 0
    writer.close()
    reader = harness(authed, extra={"token_file": str(token_file)})
    assert _run(reader, "b") == 256
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        stranger = harness(authed)  # no credential: vLLM recomputes, and says why
        assert _run(stranger, "c") == 0
    assert "credential" in caplog.text


def test_credential_settings_are_checked_at_start(
    harness: Callable[..., Harness], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/none.sock"
    token_file = tmp_path / "credential"
    token_file.write_text(TOKEN)
    with pytest.raises(InvalidArgumentError, match="not both"):
        harness(address, extra={"token": TOKEN, "token_file": str(token_file)})
    with pytest.raises(InvalidArgumentError, match="missing"):
        harness(address, extra={"token_file": str(tmp_path / "missing")})
    with pytest.raises(InvalidArgumentError, match=r"\['tokne'\].*token_file"):
        harness(address, extra={"tokne": TOKEN})


def test_the_default_model_name_carries_the_weights(tmp_path: Path) -> None:
    from testkit.vllm_configs import vllm_config

    from kvtier.integrations.vllm.config import default_model_name

    model = write_tiny_llama(tmp_path / "m", weights=True, seed=0)
    before = default_model_name(vllm_config(model, address="ipc:///x"), 32)
    assert before == default_model_name(vllm_config(model, address="ipc:///x"), 32)
    write_tiny_llama(model, weights=True, seed=1)
    after = default_model_name(vllm_config(model, address="ipc:///x"), 32)
    assert after != before
    assert after.startswith(f"vllm:{model}:w") and after.endswith(":float32:b32"), after
