"""server/reused_arrays.py: a cached buffer is handed out again only once nothing refers to it."""
import threading

import numpy as np

from server.reused_arrays import ReusedArrays


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
    arrays = ReusedArrays(keep=2, min_bytes=1024)
    first = arrays.empty((4, 256))
    first[:] = 1.0
    row = first[2:3, 10:20]  # a view of a view: it still holds the buffer
    del first
    second = arrays.empty((4, 256))
    assert not np.shares_memory(second, row), "a buffer a view still refers to was handed out"
    second[:] = 2.0
    assert (row == 1.0).all()
    del row
    third = arrays.empty((3, 256))  # the first buffer is free again
    assert arrays.reused == 1 and arrays.allocated == 2
    assert third.shape == (3, 256) and third.flags.c_contiguous and third.dtype == np.float32
    assert not np.shares_memory(third, second)


def test_a_torch_tensor_made_from_a_view_holds_the_buffer():
    import torch

    arrays = ReusedArrays(keep=1, min_bytes=1024)
    tensor = torch.from_numpy(arrays.empty((4, 256))[1:3])
    again = arrays.empty((4, 256))
    assert again.base is None and arrays.reused == 0  # the cache was full: a plain new array
    del tensor
    arrays.empty((4, 256))
    assert arrays.reused == 1


def test_past_keep_or_max_bytes_a_plain_new_array_is_made():
    arrays = ReusedArrays(keep=2, min_bytes=1024, max_bytes=3 * 2048 * 2)  # room for 1.5 buffers
    held = [arrays.empty((2, 1024)) for _ in range(3)]
    assert arrays.allocated == 1 and [a.base is None for a in held] == [False, True, True]  # max_bytes
    arrays = ReusedArrays(keep=2, min_bytes=1024)
    held = [arrays.empty((2, 1024)) for _ in range(3)]
    assert arrays.allocated == 2 and held[2].base is None  # keep
    assert not any(np.shares_memory(a, b) for i, a in enumerate(held) for b in held[i + 1:])


def test_a_new_buffer_is_as_large_as_the_largest_cached_one():
    arrays = ReusedArrays(keep=2, min_bytes=1024)
    big = arrays.empty((8, 512))  # held: the next array needs a buffer of its own
    small = arrays.empty((2, 512))
    assert small.shape == (2, 512) and small.base.shape == (8 * 512 + 8 * 512 // 4,)
    del small
    assert arrays.empty((8, 512)).shape == (8, 512) and arrays.reused == 1
    assert big.shape == (8, 512)


def test_a_free_buffer_too_small_is_replaced_by_a_larger_one():
    arrays = ReusedArrays(keep=1, min_bytes=1024)
    arrays.empty((1, 512))
    big = arrays.empty((8, 512))
    del big
    again = arrays.empty((8, 512))
    assert arrays.allocated == 2 and arrays.reused == 1 and again.shape == (8, 512)


def test_small_arrays_are_never_cached():
    arrays = ReusedArrays(keep=2, min_bytes=1 << 20)
    a = arrays.empty((4, 4))
    assert a.base is None and arrays.allocated == 0 and arrays.reused == 0


def test_threads_never_share_a_buffer():
    arrays = ReusedArrays(keep=2, min_bytes=1024)
    errors = []

    def worker(value: float):
        for _ in range(300):
            a = arrays.empty((2, 1024))
            a[:] = value
            if not (a == value).all():
                errors.append(value)

    threads = [threading.Thread(target=worker, args=(float(v),)) for v in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
