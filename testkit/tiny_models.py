"""Tiny random-weight models on disk for the engine tests and benchmarks: a Llama, the families
of `TINY_MODELS` (sliding window, MLA, hybrid Mamba / linear attention) and LoRA adapters, saved
as `save_pretrained` and PEFT save them. The keywords every family shares are written once
(`_shared`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_tiny_llama(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int = 512,
    max_positions: int = 4096,
    weights: bool = False,
    seed: int = 0,
) -> Path:
    """A random-weight Llama saved with `save_pretrained` (only config.json unless `weights`)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        torch_dtype="float32",
    )
    return _save_model(config, path, weights=weights, seed=seed)


def _save_model(config: Any, path: Path, *, weights: bool, seed: int) -> Path:
    """`config` with random weights (float32) when `weights`, else only config.json."""
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


@dataclass(frozen=True)
class TinyShape:
    """The sizes of a `write_tiny_model` model (each family uses those it has)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 512
    max_positions: int = 4096
    window: int = 128  # sliding window


def _shared(s: TinyShape) -> dict[str, Any]:
    """The config keywords every family takes the same way (float32 weights)."""
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "max_position_embeddings": s.max_positions,
        "dtype": "float32",
    }


def _gemma3(s: TinyShape) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_shared(s),
        num_hidden_layers=s.layers,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        query_pre_attn_scalar=s.head_dim,
        sliding_window=s.window,
        layer_types=["sliding_attention"] * (s.layers - 1) + ["full_attention"],
    )


def _gpt_oss(s: TinyShape) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_shared(s),
        num_hidden_layers=s.layers,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=s.window,
        layer_types=["sliding_attention", "full_attention"] * (s.layers // 2),
    )


def _deepseek_v2(s: TinyShape) -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **_shared(s),
        num_hidden_layers=s.layers,
        num_key_value_heads=s.heads,
        kv_lora_rank=512,  # the CPU MLA backend's latent width (512 + rope 64 = head size 576)
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=s.head_dim,
        v_head_dim=s.head_dim,
        first_k_dense_replace=s.layers,  # every layer dense: no MoE
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=s.intermediate,
    )


def _qwen3_next(s: TinyShape) -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_shared(s),
        num_hidden_layers=s.layers,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=s.intermediate,
        shared_expert_intermediate_size=s.intermediate,
        layer_types=["linear_attention"] * (s.layers - 1) + ["full_attention"],
    )


def _nemotron_h(s: TinyShape) -> Any:
    from transformers import NemotronHConfig

    # Mamba2 and MLP layers, one attention layer last: "M" Mamba2, "-" MLP, "*" attention
    pattern = ("M-" * s.layers)[: s.layers - 1] + "*"
    return NemotronHConfig(
        **_shared(s),
        hybrid_override_pattern=pattern,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=64,
        n_groups=2,
        chunk_size=64,
    )


# family -> (config builder, the family's own TinyShape defaults)
TINY_MODELS: dict[str, tuple[Callable[[TinyShape], Any], dict[str, int]]] = {
    "gemma3": (_gemma3, {}),
    "gpt-oss": (_gpt_oss, {}),
    "deepseek-v2": (_deepseek_v2, {}),
    # attention heads of 128: vLLM raises the attention block to 256 tokens (its page must hold
    # a linear-attention state page), not 640 as with heads of 64
    "qwen3-next": (_qwen3_next, {"head_dim": 128}),
    "nemotron-h": (_nemotron_h, {}),
}


def write_tiny_model(
    path: Path, family: str, *, weights: bool = True, seed: int = 0, **shape: int
) -> Path:
    """A random-weight model of one of `TINY_MODELS`' families (sliding window, MLA, hybrid
    Mamba / linear attention) saved with `save_pretrained`; `shape`: `TinyShape` fields."""
    build, defaults = TINY_MODELS[family]
    config = build(TinyShape(**{**defaults, **shape}))
    return _save_model(config, path, weights=weights, seed=seed)


def write_lora_adapter(
    path: Path, model_dir: Path, *, seed: int, rank: int = 8, std: float = 0.2
) -> Path:
    """A random LoRA adapter on the attention's q and v projections of the model in
    `model_dir`, written as PEFT writes one (adapter_config.json + adapter_model.safetensors).
    Its B matrices are not zero (PEFT starts them at zero), so it changes the model's answers."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    head = hidden // int(cfg["num_attention_heads"])
    outs = {"q_proj": hidden, "v_proj": int(cfg["num_key_value_heads"]) * head}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for proj, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outs),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def write_tiny_eagle(path: Path, target_dir: Path, *, method: str = "eagle", seed: int = 1) -> Path:
    """A random-weight one-layer EAGLE (`method` "eagle") or EAGLE-3 ("eagle3") draft head for
    the Llama in `target_dir`, laid out as the published heads are: a Llama config, the head's
    decoder layer and its `fc` (EAGLE-3: `midlayer`, `fc` over two of the target's hidden
    states, its own norm and `lm_head`); the embeddings are the target's."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = json.loads((target_dir / "config.json").read_text())
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head = hidden // heads
    config = LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen) * 0.05

    layer = "layers.0" if method == "eagle" else "midlayer"
    attn_in = hidden if method == "eagle" else 2 * hidden  # EAGLE-3: [embeds, hidden]
    tensors = {
        f"{layer}.self_attn.q_proj.weight": rand(heads * head, attn_in),
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head, attn_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head, attn_in),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}.post_attention_layernorm.weight": torch.ones(hidden),
    }
    if method == "eagle":
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
    elif method == "eagle3":
        aux = [0, int(cfg["num_hidden_layers"]) - 1]  # the target layers it reads
        config.eagle_config = {"eagle_aux_hidden_state_layer_ids": aux}
        tensors["fc.weight"] = rand(hidden, len(aux) * hidden)
        tensors[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{layer}.hidden_norm.weight"] = torch.ones(hidden)
        tensors["norm.weight"] = torch.ones(hidden)
        tensors["lm_head.weight"] = rand(int(cfg["vocab_size"]), hidden)
    else:
        raise ValueError(f"method {method!r}: eagle or eagle3")
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
