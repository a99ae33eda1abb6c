"""The oracle against PyTorch's own attention, and the tolerance helper that judges by it."""

import pytest
import torch
import torch.nn.functional as F

from minipaged.ops import attention_oracle, decode_oracle, prefill_oracle
from minipaged.ops.testing import assert_close


def sdpa(q, k, v, scale, causal=False):
    """PyTorch's attention on one sequence in our [tokens, heads, dim] layout."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def qkv(n, length, num_kv_heads, head_dim, seed=0, num_heads=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, num_heads, head_dim, generator=g),
        torch.randn(length, num_kv_heads, head_dim, generator=g),
        torch.randn(length, num_kv_heads, head_dim, generator=g),
    )


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_sdpa_without_mask(num_kv_heads, head_dim):
    q, k, v = qkv(5, 37, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    assert_close(attention_oracle(q, k, v, scale), sdpa(q, k, v, scale))


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n", [1, 6, 37])
def test_causal_queries_are_the_last_rows_of_full_causal_attention(num_kv_heads, head_dim, n):
    """The last n queries of a causal prefill over all 37 tokens, asked on their own."""
    q, k, v = qkv(37, 37, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    full = sdpa(q, k, v, scale, causal=True)
    assert_close(attention_oracle(q[-n:], k, v, scale, causal=True), full[-n:])


def test_half_precision_in_half_out():
    q, k, v = (t.half() for t in qkv(20, 20, 2, 64))
    out = attention_oracle(q[-4:], k, v, 0.125, causal=True)
    assert out.dtype == torch.float16
    assert_close(out, sdpa(q.float(), k.float(), v.float(), 0.125, causal=True)[-4:], torch.float16)


def test_equal_scores_average_the_values():
    q, _, v = qkv(3, 10, 2, 64)
    k = torch.ones(10, 2, 64)  # every key the same: every weight 1/10
    assert_close(
        attention_oracle(q, k, v, 0.125), v.mean(0).repeat_interleave(4, 0).expand(3, 8, 64)
    )


def test_first_causal_query_sees_only_the_first_token():
    q, k, v = qkv(10, 10, 8, 64)
    assert_close(attention_oracle(q, k, v, 0.125, causal=True)[0], v[0])


def test_decode_and_prefill_oracles_split_by_sequence():
    lengths, new = [3, 11, 7], [3, 2, 1]
    seqs = [qkv(n, length, 4, 64, seed=i) for i, (n, length) in enumerate(zip(new, lengths))]
    query = torch.cat([q for q, _, _ in seqs])
    keys, values = [k for _, k, _ in seqs], [v for _, _, v in seqs]
    expected = torch.cat(
        [
            sdpa(torch.cat([torch.zeros(length - n, 8, 64), q]), k, v, 0.125, causal=True)[-n:]
            for (q, k, v), n, length in zip(seqs, new, lengths)
        ]
    )
    assert_close(prefill_oracle(query, [0, 3, 5, 6], keys, values, 0.125), expected)

    last = torch.stack([q[-1] for q, _, _ in seqs])
    expected = torch.stack([sdpa(q[-1:], k, v, 0.125)[0] for q, k, v in seqs])
    assert_close(decode_oracle(last, keys, values, 0.125), expected)


def test_assert_close_reports_the_worst_elements():
    expected = torch.zeros(4, 8, 64)
    actual = expected.clone()
    actual[2, 5, 7] = 0.5
    actual[1, 0, 3] = 0.01
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected)
    message = str(failure.value)
    assert "2 of 2048 elements" in message
    assert message.index("(2, 5, 7)") < message.index("(1, 0, 3)")
    assert_close(actual[0], expected[0])


def test_assert_close_scales_with_dtype_and_rejects_nan():
    expected = torch.ones(16)
    assert_close(expected + 1e-3, expected, torch.float16)
    with pytest.raises(AssertionError):
        assert_close(expected + 1e-3, expected, torch.float32)
    with pytest.raises(AssertionError):
        assert_close(torch.full((16,), float("nan")), expected, torch.bfloat16)
