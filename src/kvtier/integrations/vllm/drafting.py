"""Speculative decoding as the connector sees it: which drafter the engine runs, whether its KV
is in the cache kvtier stores, and how far past a position that KV reads.

An EAGLE, EAGLE-3 or MTP drafter builds its KV at a position from the target's hidden state
there and the next token (multi-module MTP: the next few). A stored chunk's last positions thus
carry draft KV that was built with tokens the chunk's name does not cover; vLLM's own prefix
cache then drops the last block of a hit, so that the tokens right before the point where the
request resumes are computed again. The connector's hit obeys the same rule: it ends at least
`lookahead` tokens before the end of what kvtier holds (`hit_point`), so every loaded position's
draft KV was built with the tokens of this request. N-gram and suffix drafting keep no KV.

A drafter with KV layers stores them in the same chunks as the target's (they are layers of
vLLM's KV cache groups like any other), so its identity goes in the model's name: engines with
other draft heads, or none, never read each other's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.integrations.fingerprint import model_identity

#: methods whose drafter keeps no KV in vLLM's cache: their engines share the target's chunks
KV_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


@dataclass(frozen=True)
class Drafting:
    """The engine's speculative decoding, as far as stored KV goes."""

    method: str = ""  # vLLM's speculative method ("" without --speculative-config)
    drafter: str = ""  # the draft weights' label ("" when the drafter keeps no KV)
    lookahead: int = 0  # tokens past a position that its draft KV reads
    reprefill: int = 0  # trailing computed tokens whose draft KV vLLM computes again

    def name_suffix(self, *, explicit: bool) -> str:
        """What the drafter adds to the model's name: its method and, for a default name, its
        weights (an explicit `model` name stands for the target's and the drafter's weights)."""
        if not self.drafter:
            return ""
        return f":d{self.method}" if explicit else f":d{self.method}@{self.drafter}"


def drafting(vllm_config: Any) -> Drafting:
    """Reads vLLM's speculative config (none: no drafting)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return Drafting()
    method = str(spec.method)
    drafter = ""
    draft_config = getattr(spec, "draft_model_config", None)
    if method not in KV_FREE_METHODS and draft_config is not None:
        drafter = model_identity(
            str(draft_config.model), getattr(draft_config, "revision", None)
        ).label
    # vLLM drops the hit's last block where the draft KV reads ahead (EAGLE, EAGLE-3, MTP),
    # unless told not to (disable_eagle_block_drop); older versions: every use_eagle method
    drop = getattr(spec, "use_eagle_block_drop", spec.use_eagle)()
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1)) if drop else 0
    return Drafting(method, drafter, lookahead, max(0, lookahead - 1))


def hit_point(stored: int, num_tokens: int, unit: int, lookahead: int) -> int:
    """Where a request resumes, given the `stored` leading tokens kvtier holds for it: whole
    `unit`s, short of the request's last token (vLLM needs its logits), and `lookahead` tokens
    short of `stored` (the draft KV there read tokens past what kvtier matched)."""
    usable = (num_tokens - 1) // unit * unit
    vouched = max(0, stored - lookahead) // unit * unit if lookahead else stored
    return max(0, min(vouched, usable))
