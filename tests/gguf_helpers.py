"""Writing a small GGUF file from a local Llama folder, so the GGUF tests need no download.

The layout follows llama.cpp's conventions as transformers' GGUF loader reads them back:
llama.cpp tensor names, the query/key rows regrouped for its rotary layout, a byte-level
("gpt2") tokenizer with its merges and control tokens, the output matrix left out when tied.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers' Llama names (inside model.layers.N.) → llama.cpp's (inside blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def rotary_regroup(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores each head's query/key rows as (first half, second half) pairs
    interleaved; transformers' loader undoes exactly this."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.N.<module>.weight
    module, _, kind = rest.rpartition(".")
    return f"blk.{index}.{LAYER_NAMES[module]}.{kind}"


def _write_tokenizer(writer, folder: Path, config: dict) -> None:
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([control if t in special else normal for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    template = folder / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())


def write_gguf(folder: Path, path: Path, half: bool = False, arch: str = "llama") -> Path:
    """``folder`` (a Llama causal LM saved by transformers) as the GGUF file ``path``; its
    matrices in F16 when ``half``, everything else F32."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("rlhflab test model")
    writer.add_file_type(1 if half else 0)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _write_tokenizer(writer, folder, config)
    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if ".q_proj." in name:
            weight = rotary_regroup(weight, heads)
        elif ".k_proj." in name:
            weight = rotary_regroup(weight, kv_heads)
        dtype = np.float16 if half and weight.ndim == 2 else np.float32
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight.astype(dtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
