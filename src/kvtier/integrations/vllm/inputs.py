"""What besides its tokens changes a vLLM request's KV, folded into kvtier's per-request
`extra_key`: the LoRA adapter, the multimodal inputs and the prompt embeddings, the same
inputs vLLM folds into its own block hashes' extra keys.

Chunks stored under one extra_key are never found under another, so a request with an adapter
never reads the base model's KV, nor another adapter's. A request with none of these inputs
uses b"", the key of plain token prompts. An input the connector cannot name exactly (an
adapter whose files are not on this machine, a multimodal item without a hash) makes the
request uncacheable: `request_extra_key` returns None, and the request gets no hit and saves
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import msgspec

from kvtier.integrations.fingerprint import adapter_identity

__all__ = ["AdapterFingerprints", "RequestInputs", "extra_key", "request_extra_key"]

_SCHEMA = "kvtier-vllm-inputs/1"


@dataclass(frozen=True)
class RequestInputs:
    """A request's KV-changing inputs besides its tokens, each named exactly."""

    lora: tuple[str, str] | None = None  # (lora_name, fingerprint of the adapter's files)
    mm: tuple[tuple[str, int, int], ...] = ()  # (mm hash, placeholder offset, length), in order
    prompt_embeds: bytes | None = None  # digest of the embeddings' dtype, shape and bytes

    @property
    def plain(self) -> bool:
        return self.lora is None and not self.mm and self.prompt_embeds is None


def extra_key(inputs: RequestInputs) -> bytes:
    """b"" for a plain request; else the blake3 digest (32 bytes) of the inputs' msgpack
    encoding, which is structured (lists, typed strings, ints, bytes) and hence injective: no
    two different inputs encode alike, whatever characters a name holds."""
    if inputs.plain:
        return b""
    encoded = msgspec.msgpack.encode(
        [
            _SCHEMA,
            None if inputs.lora is None else list(inputs.lora),
            [list(m) for m in inputs.mm],
            inputs.prompt_embeds,
        ]
    )
    return blake3.blake3(encoded).digest()


def embeds_digest(embeds: Any) -> bytes:
    """The digest of a prompt-embeddings tensor: its dtype, shape and bytes."""
    import torch

    tensor = embeds.detach().to("cpu").contiguous()
    hasher = blake3.blake3(msgspec.msgpack.encode([str(tensor.dtype), list(tensor.shape)]))
    hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.digest()


class AdapterFingerprints:
    """Each LoRA adapter's fingerprint, computed once per (name, id, path) as vLLM loads an
    adapter once per id; an adapter loaded in place (`load_inplace`) is looked at again."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, str], str | None] = {}

    def of(self, lora_request: Any) -> str | None:
        key = (str(lora_request.lora_name), int(lora_request.lora_int_id), lora_request.lora_path)
        if getattr(lora_request, "load_inplace", False) or key not in self._known:
            self._known[key] = adapter_identity(str(lora_request.lora_path))
        return self._known[key]


def request_inputs(request: Any, adapters: AdapterFingerprints) -> RequestInputs | None:
    """The inputs of a vllm.v1.request.Request, or None when one cannot be named exactly."""
    lora: tuple[str, str] | None = None
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        fingerprint = adapters.of(lora_request)
        if fingerprint is None:
            return None
        lora = (str(lora_request.lora_name), fingerprint)
    mm: list[tuple[str, int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return None
        mm.append((str(identifier), int(position.offset), int(position.length)))
    embeds = getattr(request, "prompt_embeds", None)
    digest = None if embeds is None else embeds_digest(embeds)
    return RequestInputs(lora=lora, mm=tuple(mm), prompt_embeds=digest)


def request_extra_key(request: Any, adapters: AdapterFingerprints) -> bytes | None:
    """The request's extra_key, or None: the request is not to be cached."""
    inputs = request_inputs(request, adapters)
    return None if inputs is None else extra_key(inputs)
