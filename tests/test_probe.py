"""Tests of the OAR outcome probe (oar.credit.probe, docs/methods.md, 4.1 The outcome probe)."""

from __future__ import annotations

import pytest
import torch

from oar.credit.probe import DEFAULT_CONCLUDE, Probe, build_probe, locate_answer_tokens
from oar.models.tiny import build_tiny_tokenizer

PAD = 0


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def enc(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def right_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (n - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
    return ids, mask


def test_exact_ids_left_padded_prompts_right_padded_responses(tok):
    eos = tok.eos_token_id
    prompts = [enc(tok, "Q1?"), enc(tok, "Q22?")]
    responses = [enc(tok, "ab\\boxed{7}") + [eos], enc(tok, "xyz \\boxed{12}.")]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    conc = enc(tok, " A:")
    probe = build_probe(tok, p_ids, r_ids, conclude=" A:", prompt_mask=p_mask, response_mask=r_mask)

    row0 = prompts[0] + enc(tok, "ab") + conc + enc(tok, "7")
    row1 = prompts[1] + enc(tok, "xyz ") + conc + enc(tok, "12")
    L = max(len(row0), len(row1))
    assert probe.input_ids.shape == (2, L) == (2, 13)
    assert probe.input_ids[0].tolist() == [PAD] * 4 + row0
    assert probe.input_ids[1].tolist() == row1
    assert probe.attention_mask[0].tolist() == [0] * 4 + [1] * 9
    assert probe.attention_mask[1].tolist() == [1] * 13
    # row 0: pad x4 | Q 1 ? | a b | ' ' A : | 7   ('7' is response token 9)
    assert probe.reasoning_mask[0].tolist() == [False] * 7 + [True] * 2 + [False] * 4
    assert probe.answer_mask[0].tolist() == [False] * 12 + [True]
    assert probe.position_map[0].tolist() == [-1] * 7 + [0, 1] + [-1] * 3 + [9]
    # row 1: Q 2 2 ? | x y z ' ' | ' ' A : | 1 2
    assert probe.reasoning_mask[1].tolist() == [False] * 4 + [True] * 4 + [False] * 5
    assert probe.answer_mask[1].tolist() == [False] * 11 + [True] * 2
    assert probe.position_map[1].tolist() == [-1] * 4 + [0, 1, 2, 3] + [-1] * 3 + [11, 12]
    assert probe.has_answer.tolist() == [True, True]
    assert probe.last_index.tolist() == [L - 2, L - 3]
    assert probe.response_length == r_ids.shape[1]
    assert probe.pad_token_id == PAD


def test_position_map_of_reasoning_tokens(tok):
    prompts = [enc(tok, "Q1?")]
    responses = [enc(tok, "ab\\boxed{7}")]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    probe = build_probe(tok, p_ids, r_ids, conclude=" A:", prompt_mask=p_mask, response_mask=r_mask)
    # Q 1 ? | a b | ' ' A : | 7
    assert probe.position_map[0].tolist() == [-1, -1, -1, 0, 1, -1, -1, -1, 9]


def test_no_answer_rows_are_kept_with_zero_masks(tok):
    prompts = [enc(tok, "P"), enc(tok, "PP"), enc(tok, "PPP"), enc(tok, "Q")]
    responses = [
        enc(tok, "no box here"),
        enc(tok, "cut \\boxed{12"),  # truncated: no closing brace
        enc(tok, "empty \\boxed{}"),
        enc(tok, "ok \\fbox{5}"),
    ]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    probe = build_probe(tok, p_ids, r_ids, conclude="=", prompt_mask=p_mask, response_mask=r_mask)
    assert probe.has_answer.tolist() == [False, False, False, True]
    assert probe.last_index[:3].tolist() == [-1, -1, -1]
    assert not probe.reasoning_mask[:3].any() and not probe.answer_mask[:3].any()
    assert (probe.position_map[:3] == -1).all()
    # a row without answer holds its prompt only
    assert probe.input_ids[2, -3:].tolist() == enc(tok, "PPP")
    assert probe.attention_mask[2].sum() == 3
    assert probe.input_ids[3].tolist() == enc(tok, "Q") + enc(tok, "ok ") + enc(tok, "=") + enc(tok, "5")


def test_nested_braces_and_last_box_wins(tok):
    r = enc(tok, "\\boxed{1} then \\boxed{\\frac{1}{2}} done")
    loc = locate_answer_tokens(tok, r)
    assert loc is not None
    n_r, a0, a1 = loc
    text = "\\boxed{1} then \\boxed{\\frac{1}{2}} done"
    assert n_r == text.rfind("\\boxed{")
    assert text[a0:a1] == "\\frac{1}{2}"


def test_masks_default_to_pad_comparison(tok):
    prompts = [enc(tok, "ab"), enc(tok, "c")]
    responses = [enc(tok, "x\\boxed{1}"), enc(tok, "yy\\boxed{22}")]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    a = build_probe(tok, p_ids, r_ids, conclude=":")
    b = build_probe(tok, p_ids, r_ids, conclude=":", prompt_mask=p_mask, response_mask=r_mask)
    for f in ("input_ids", "attention_mask", "reasoning_mask", "answer_mask", "position_map", "last_index"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_default_conclude_is_appended(tok):
    p_ids, p_mask = left_pad([enc(tok, "q")])
    r_ids, r_mask = right_pad([enc(tok, "r\\boxed{3}")])
    probe = build_probe(tok, p_ids, r_ids, prompt_mask=p_mask, response_mask=r_mask)
    assert probe.input_ids[0].tolist() == enc(tok, "q") + enc(tok, "r") + enc(tok, DEFAULT_CONCLUDE) + enc(tok, "3")


def test_to_response_scatters_back(tok):
    prompts = [enc(tok, "Q1?"), enc(tok, "Q")]
    responses = [enc(tok, "ab\\boxed{7}"), enc(tok, "none")]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    probe = build_probe(tok, p_ids, r_ids, conclude=" A:", prompt_mask=p_mask, response_mask=r_mask)
    vals = torch.arange(probe.input_ids.numel(), dtype=torch.float32).reshape(probe.input_ids.shape) + 1
    out = probe.to_response(vals * probe.reasoning_mask)
    assert out.shape == r_ids.shape
    # row 0: reasoning 'a' 'b' are probe positions 3, 4 -> response positions 0, 1
    assert out[0, :2].tolist() == [vals[0, 3].item(), vals[0, 4].item()]
    assert (out[0, 2:] == 0).all() and (out[1] == 0).all()
    filled = probe.to_response(probe.reasoning_mask.float(), 20, fill=-1.0)
    assert filled.shape == (2, 20)
    assert filled[0, :2].tolist() == [1.0, 1.0] and filled[0, 9].item() == 0.0 and filled[0, 3].item() == -1.0
    with pytest.raises(ValueError, match="to_response"):
        probe.to_response(vals[:, 1:])


def test_select_trims_common_left_padding(tok):
    prompts = [enc(tok, "long prompt"), enc(tok, "Q")]
    responses = [enc(tok, "a\\boxed{1}"), enc(tok, "bb\\boxed{2}")]
    p_ids, p_mask = left_pad(prompts)
    r_ids, r_mask = right_pad(responses)
    probe = build_probe(tok, p_ids, r_ids, conclude=":", prompt_mask=p_mask, response_mask=r_mask)
    sub = probe.select([1])
    assert sub.input_ids.shape == (1, int(probe.attention_mask[1].sum()))
    assert sub.input_ids[0].tolist() == enc(tok, "Q") + enc(tok, "bb") + enc(tok, ":") + enc(tok, "2")
    assert sub.last_index.tolist() == [sub.input_ids.shape[1] - 2]
    assert torch.equal(sub.position_ids[0], torch.arange(sub.input_ids.shape[1]))
    both = probe.select(torch.tensor([True, True]))
    assert torch.equal(both.input_ids, probe.input_ids)


def test_position_ids_ignore_left_padding(tok):
    p_ids, p_mask = left_pad([enc(tok, "abc"), enc(tok, "a")])
    r_ids, r_mask = right_pad([enc(tok, "\\boxed{1}"), enc(tok, "\\boxed{1}")])
    probe = build_probe(tok, p_ids, r_ids, conclude=":", prompt_mask=p_mask, response_mask=r_mask)
    assert probe.position_ids[1].tolist() == [0, 0, 0, 1, 2]
    assert probe.position_ids[0].tolist() == [0, 1, 2, 3, 4]


def test_bad_inputs_raise(tok):
    p_ids, p_mask = left_pad([enc(tok, "a")])
    r_ids, r_mask = right_pad([enc(tok, "\\boxed{1}")])
    with pytest.raises(ValueError, match="build_probe"):
        build_probe(tok, p_ids[0], r_ids)
    with pytest.raises(ValueError, match="response_mask"):
        build_probe(tok, p_ids, r_ids, response_mask=r_mask[:, 1:])


class MultiCharTokenizer:
    """A tokenizer with multi-character tokens, ``\u2581`` standing for a space. With
    ``strip=True`` ``decode`` drops the leading space of its output (as SentencePiece does), so
    single-token decodes do not concatenate to the full text, which forces the prefix-length
    search."""

    def __init__(self, pieces: list[str], strip: bool):
        self.vocab = ["<pad>"] + pieces
        self.pad_token_id = 0
        self.strip = strip

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        text = "".join(self.vocab[i] for i in ids).replace("\u2581", " ")
        return text.lstrip(" ") if self.strip else text

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.index(text)]}


@pytest.mark.parametrize("strip", [False, True])
def test_multi_character_tokens_map_to_token_positions(strip):
    # text "so x \\boxed{42} end": the marker starts inside token 2, "42" spans tokens 3 and 4
    pieces = ["so", "\u2581x", "\u2581\\bo", "xed{4", "2}", "\u2581end", "Z"]
    tok = MultiCharTokenizer(pieces, strip)
    ids = [1, 2, 3, 4, 5, 6]
    assert tok.decode(ids) == "so x \\boxed{42} end"
    assert locate_answer_tokens(tok, ids) == (2, 3, 5)
    p_ids = torch.tensor([[0, 7]])
    r_ids = torch.tensor([ids + [0]])
    probe = build_probe(tok, p_ids, r_ids, conclude="Z")
    assert probe.input_ids[0].tolist() == [7, 1, 2, 7, 4, 5]
    assert probe.reasoning_mask[0].tolist() == [False, True, True, False, False, False]
    assert probe.answer_mask[0].tolist() == [False, False, False, False, True, True]
    assert probe.position_map[0].tolist() == [-1, 0, 1, -1, 3, 4]
    assert probe.last_index.tolist() == [3]


def test_probe_is_a_dataclass_with_documented_fields(tok):
    p_ids, p_mask = left_pad([enc(tok, "a")])
    r_ids, r_mask = right_pad([enc(tok, "\\boxed{1}")])
    probe = build_probe(tok, p_ids, r_ids, conclude=":")
    assert isinstance(probe, Probe)
    assert probe.reasoning_mask.dtype == torch.bool and probe.answer_mask.dtype == torch.bool
    assert probe.attention_mask.dtype == torch.long and probe.position_map.dtype == torch.long
    assert probe.answer_length.tolist() == [1]
