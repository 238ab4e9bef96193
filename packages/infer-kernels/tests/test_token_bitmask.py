"""apply_token_bitmask against a loop over every (row, token) bit, and the kernel against it."""

import pytest
import torch

from infer.kernels import apply_token_bitmask, apply_token_bitmask_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(batch, vocab_size, num_words, rows, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=gen).to(device, dtype)
    # Random 32-bit words, negative ones too (bit 31 set), plus an all-zero and an all-one word.
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), num_words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = 0
    if num_words > 1:
        bitmask[-1, 1] = -1
    return logits, bitmask.to(device), torch.tensor(rows, device=device)


def bit_loop(logits, bitmask, rows):
    """Straight from the definition: token t of row rows[i] stays only if bit t % 32 of word
    t // 32 of bitmask row i is 1 (tokens past the last word: not allowed)."""
    expected = logits.clone()
    words = bitmask.cpu().tolist()
    for i, row in enumerate(rows.tolist()):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < len(words[i]) and (words[i][word] >> (token % 32)) & 1
            if not allowed:
                expected[row, token] = -torch.inf
    return expected


# (batch, vocab, words, rows): vocab a multiple of 32, not one, wider than the bitmask, narrower.
CASES = [(4, 64, 2, [1, 3]), (3, 100, 4, [2, 0, 1]), (2, 1500, 40, [0]), (5, 70, 2, [4, 0])]


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_the_bit_loop(case):
    batch, vocab_size, num_words, rows = case
    logits, bitmask, rows_t = make_inputs(batch, vocab_size, num_words, rows, torch.float32, "cpu", 0)
    expected = bit_loop(logits, bitmask, rows_t)
    apply_token_bitmask_ref(logits, bitmask, rows_t)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_interpreted_matches_the_bit_loop(triton_on_cpu, case, dtype):
    batch, vocab_size, num_words, rows = case
    logits, bitmask, rows_t = make_inputs(batch, vocab_size, num_words, rows, dtype, "cpu", 1)
    expected = bit_loop(logits, bitmask, rows_t)
    apply_token_bitmask(logits, bitmask, rows_t)
    assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_on_the_gpu_matches_the_reference_at_real_vocab_sizes(dtype):
    # 64 rows of Llama 3's vocabulary, half of them constrained, bitmask a word short of it.
    logits, bitmask, rows = make_inputs(64, 128256, 4007, list(range(0, 64, 2)), dtype, "cuda", 2)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_rows_must_match_the_bitmask():
    logits, bitmask, rows = make_inputs(2, 64, 2, [0, 1], torch.float32, "cpu", 3)
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask(logits, bitmask, rows[:1])
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, bitmask.long(), rows)
