"""content_digest: what a batch holds, hashed from its first CPU tensor, alike in every process."""

from __future__ import annotations

import torch

from ddpscope.hooks.batchdigest import DIGEST_ELEMENTS, content_digest, first_tensor


def test_the_same_data_gives_the_same_digest_and_other_data_another() -> None:
    a = torch.arange(64.0).reshape(8, 8)
    assert content_digest(a) == content_digest(a.clone()) != 0
    assert content_digest(a) != content_digest(a + 1)
    assert content_digest(a) != content_digest(a.reshape(4, 16))  # the shape counts


def test_the_first_tensor_of_a_tuple_or_a_dict_batch_is_read() -> None:
    x, y = torch.randn(4, 3), torch.zeros(4)
    assert content_digest((x, y)) == content_digest(x) == content_digest([x])
    assert content_digest({"input_ids": x, "labels": y}) == content_digest(x)
    assert first_tensor({"meta": "text", "x": [x]}) is x


def test_batches_in_another_memory_order_or_with_gaps_are_read() -> None:
    t = torch.randn(8, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    assert not t.is_contiguous()
    assert content_digest(t) == content_digest(t.clone()) != 0
    assert content_digest(t) != content_digest(t + 1)
    crop = torch.randn(8, 3, 64, 64)[:, :, 8:56, 8:56]  # a view with gaps
    assert content_digest(crop) == content_digest(crop) != 0
    assert content_digest(crop) != content_digest(crop + 1)


def test_samples_sharing_a_prefix_still_differ() -> None:
    # A prompt template: every sequence starts alike, padding ends it alike.
    template = torch.arange(100)
    a = torch.cat([template.repeat(16, 1), torch.randint(0, 9, (16, 412))], dim=1)
    b = a.clone()
    b[5, 300] += 1  # one token of one sample
    assert content_digest(a) != content_digest(b)
    big = torch.zeros(64, 3, 64, 64)  # a large batch is sampled, spread over all of it
    other = big.clone()
    other[-1] = 1.0  # its last sample only
    assert big.numel() > DIGEST_ELEMENTS and content_digest(big) != content_digest(other)


def test_what_cannot_be_read_without_cost_gives_no_digest() -> None:
    nan = torch.tensor([float("nan"), 1.0])  # bytes are hashed: NaN is fine
    assert content_digest(nan) == content_digest(nan.clone()) != 0
    assert content_digest(torch.empty(0)) == 0
    assert content_digest(torch.empty(4, device="meta")) == 0  # not on the CPU: no sync
    assert content_digest(["no", "tensor"]) == 0
