"""The traffic benchmark's model: random-weight Llama weights and a small word-level tokenizer.

The model is shaped so that prefill dominates a request, as in real deployments: one layer of a
wide decoder (a token's linear work outweighs its attention over a few thousand tokens), float32
(this CPU has no fast bf16). The tokenizer is a word-level vocabulary built with the `tokenizers`
library and saved beside the weights with a chat template, so that vLLM's OpenAI server takes
text, chat messages included, like any deployment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VOCAB = 4096
SPECIAL = ("<unk>", "<s>", "</s>")
TEMPLATE_WORDS = ("system", "user", "assistant", ":")
# A role line per message, then the assistant's turn: plain text, so that a conversation's earlier
# turns render to the same tokens in every later request (the prefix a cache can reuse).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    layers: int = 1
    hidden: int = 1536
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 6144
    max_len: int = 4096


def words() -> list[str]:
    """The vocabulary after the special tokens: the chat template's words, then w0, w1, ..."""
    rest = VOCAB - len(SPECIAL) - len(TEMPLATE_WORDS)
    return [*TEMPLATE_WORDS, *(f"w{i}" for i in range(rest))]


def write_model(path: Path, shape: ModelShape = ModelShape(), *, seed: int = 0) -> Path:
    """Save random weights and the tokenizer at `path` (kept when already there); returns it."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *words()])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.max_len,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def kv_bytes_per_token(shape: ModelShape = ModelShape()) -> int:
    """K and V of every layer for one token, float32."""
    return shape.layers * 2 * shape.kv_heads * (shape.hidden // shape.heads) * 4
