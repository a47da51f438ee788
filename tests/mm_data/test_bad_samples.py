"""Bad-sample substitution: a substitute is never a sample already found bad for the same index,
so a set with 2 bad samples of 6 trains through every epoch (each bad sample is replaced by a good
one, drawn the same way on every layout); a bucket with no good sample left is a clear error."""

import numpy as np
import pytest

from mm_data.errors import BadSample, DataError
from mm_data.loader import DataLoader, build_batch
from mm_data.sampler import BucketBatchSampler


class Samples:
    """``n`` samples whose value is their index; those in ``bad`` raise BadSample."""

    def __init__(self, n, bad):
        self.n, self.bad, self.read = n, set(bad), []

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.read.append(index)
        if index in self.bad:
            raise BadSample(f"sample{index}.png", "unreadable image")
        return {"x": np.array([index])}


def collate(samples):
    return {"x": np.concatenate([s["x"] for s in samples])}


def test_two_bad_of_six_are_always_replaced_by_good_samples():
    data = Samples(6, bad={3, 4})
    loader = DataLoader(data, BucketBatchSampler(6, 6, seed=0), collate=collate, max_substitutes=3)
    iterator = iter(loader)
    batches = [next(iterator)["x"] for _ in range(50)]  # 50 epochs of one batch each
    iterator.close()
    assert all(len(b) == 6 and not set(b.tolist()) & {3, 4} for b in batches)
    # a bad sample is read only as itself, never again as a substitute for the same index
    assert data.read.count(3) <= 2 * len(batches) and data.read.count(4) <= 2 * len(batches)


def test_substitutes_are_the_same_on_every_data_parallel_layout():
    data = Samples(8, bad={1, 5})
    whole = build_batch(data, BucketBatchSampler(8, 8, seed=3), collate, 0, np.arange(8), 3)[0]["x"]
    halves = [build_batch(data, BucketBatchSampler(8, 8, r, 2, seed=3), collate, 0, np.arange(8)[4 * r:4 * r + 4],
                          3)[0]["x"] for r in range(2)]
    np.testing.assert_array_equal(whole, np.concatenate(halves))


def test_a_bucket_without_good_samples_names_them_all():
    data = Samples(4, bad={0, 1, 2, 3})
    with pytest.raises(DataError, match=r"every other sample of its bucket \(4 in all\) are bad") as info:
        build_batch(data, BucketBatchSampler(4, 2, seed=0), collate, 0, np.array([0]), 10)
    assert all(f"sample{i}.png" in str(info.value) for i in range(4))
