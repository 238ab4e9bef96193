"""argmax against torch.argmax (the oracle): the first index of a row's max, ties, -inf rows and
NaNs included, for any row length, chunk boundaries and batch of rows."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.kernels import argmax, argmax_ref
from infer.kernels.argmax import _BLOCK


def logits_with_features(num_rows, num_cols, dtype, device, seed, *, ties, nans, neg_inf_rows):
    """Random rows; with `ties`, each row's max copied to other random places (some in other
    chunks); with `nans`, NaNs in some rows; with `neg_inf_rows`, a row of -inf alone."""
    gen = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(num_rows, num_cols, generator=gen, device=device).to(dtype)
    if ties:
        best = logits.max(dim=-1, keepdim=True).values
        places = torch.randint(0, num_cols, (num_rows, 3), generator=gen, device=device)
        logits.scatter_(1, places, best.expand(-1, 3))
    if nans:
        places = torch.randint(0, num_cols, (num_rows, 2), generator=gen, device=device)
        rows = torch.arange(num_rows, device=device)[::2]
        logits[rows[:, None], places[::2]] = float("nan")
    if neg_inf_rows:
        logits[-1] = -float("inf")
    return logits


def assert_matches_torch(logits):
    out = argmax(logits)
    expected = torch.argmax(logits, dim=-1)
    assert out.dtype == torch.int64 and out.shape == expected.shape
    assert torch.equal(out, expected), (out, expected)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_rows=st.integers(1, 5),
    num_cols=st.integers(1, 3 * _BLOCK + 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ties=st.booleans(),
    nans=st.booleans(),
    neg_inf_rows=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_interpreted_matches_torch(triton_on_cpu, num_rows, num_cols, dtype, ties, nans, neg_inf_rows, seed):
    logits = logits_with_features(
        num_rows, num_cols, dtype, "cpu", seed, ties=ties, nans=nans, neg_inf_rows=neg_inf_rows
    )
    assert_matches_torch(logits)


def test_interpreted_ties_across_chunks_take_the_first(triton_on_cpu):
    logits = torch.zeros(2, 3 * _BLOCK)
    logits[0, [5, _BLOCK + 1, 2 * _BLOCK + 7]] = 1.0  # the max in three chunks
    logits[1, [2 * _BLOCK + 7, _BLOCK + 1]] = 1.0  # in the last two
    assert argmax(logits).tolist() == [5, _BLOCK + 1]


def test_interpreted_keeps_leading_dims_and_reads_strided_rows(triton_on_cpu):
    logits = torch.randn(2, 3, 2 * _BLOCK + 3)
    assert_matches_torch(logits)
    assert_matches_torch(logits[:, :, ::2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 64])
@pytest.mark.parametrize("num_cols", [49152, 128256, 151936, 262144])
def test_cuda_vocabularies_match_torch(cuda, num_rows, num_cols, dtype):
    """SmolLM2's, Llama 3's, Qwen 3's and Gemma 3's vocabularies, with ties, NaNs and a -inf row."""
    for seed, (ties, nans) in enumerate([(False, False), (True, False), (True, True)]):
        logits = logits_with_features(
            num_rows, num_cols, dtype, cuda, seed, ties=ties, nans=nans, neg_inf_rows=num_rows > 1
        )
        assert_matches_torch(logits)


def test_cpu_path_is_torch():
    logits = torch.randn(3, 1000)
    assert torch.equal(argmax(logits), argmax_ref(logits))
    assert torch.equal(argmax_ref(logits), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.randn(3, 0), "non-empty last dim"),
        (torch.tensor(1.0), "non-empty last dim"),
        (torch.randn(3, 5, dtype=torch.float64), "logits must be float32, float16 or bfloat16"),
    ],
)
def test_rejects_bad_inputs(logits, message):
    with pytest.raises(ValueError, match=message):
        argmax(logits)
