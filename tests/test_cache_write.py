"""glm5_ops.cache_write (glm5::cache_write): the paged cache's store, in place,
against reference.cache_write on fresh random rows, every backend and dtype;
its argument errors; and the compiled decode step it exists for
(GLM5ForCausalLM.compile_decode), which must give the eager step's tokens."""
import pytest
import torch

import glm5_ops
from conftest import DEVICE, fresh
from glm5_ops import reference
from glm5_ops._backend import BACKENDS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("P,D,N", [(1, 1, 1), (37, 13, 5), (300, 576, 64)])
def test_matches_reference(backend, dtype, P, D, N):
    pool = fresh(P, D, dtype=dtype)
    pool[P // 2] = float("nan")                   # a row not written must come back as it was, NaN included
    slots = torch.randperm(P, device=DEVICE)[:N]
    values = fresh(N, D, dtype=dtype)
    expect = reference.cache_write(pool, slots, values)
    ptr = pool.data_ptr()
    assert glm5_ops.cache_write(pool, slots, values) is None
    assert pool.data_ptr() == ptr                 # written in place
    torch.testing.assert_close(pool, expect, rtol=0, atol=0, equal_nan=True)   # a copy: exact for every dtype


def test_strided_values_and_empty_slots(backend):
    pool = fresh(20, 8)
    wide = fresh(3, 16)
    glm5_ops.cache_write(pool, torch.tensor([19, 0, 5], device=DEVICE), wide[:, ::2])
    torch.testing.assert_close(pool[[19, 0, 5]], wide[:, ::2], rtol=0, atol=0)
    before = pool.clone()
    glm5_ops.cache_write(pool, torch.empty(0, dtype=torch.long, device=DEVICE), fresh(0, 8))
    torch.testing.assert_close(pool, before, rtol=0, atol=0)
    glm5_ops.cache_write(fresh(5, 0), torch.tensor([4, 0], device=DEVICE), fresh(2, 0))   # rows of no elements
    if DEVICE == "cpu":      # their slots are still checked (on a GPU: index_copy_'s device assert)
        with pytest.raises(ValueError, match="slots must hold rows of pool"):
            glm5_ops.cache_write(fresh(5, 0), torch.tensor([5], device=DEVICE), fresh(1, 0))


def test_row_strided_pool_and_values_and_strided_slots(backend):
    """The rows-at-a-time path (row-contiguous pool and values, any row stride): only the
    slots' rows of the pool view change, nothing beside them in the underlying storage."""
    storage = fresh(30, 12)
    pool = storage[::2, 2:9]                      # [15, 7]: row stride 24, columns contiguous
    values = fresh(4, 10)[:, 1:8]                 # [4, 7]: row stride 10
    slots = torch.tensor([3, 99, 14, 99, 0, 99, 7], device=DEVICE)[::2]
    expect = storage.clone()
    expect[::2, 2:9] = reference.cache_write(expect[::2, 2:9], slots, values)
    glm5_ops.cache_write(pool, slots, values)
    torch.testing.assert_close(storage, expect, rtol=0, atol=0)


BAD = [
    (lambda: (fresh(4, 3, 2), torch.tensor([0]), fresh(1, 2)), ValueError, "pool", "pool must have shape [P,D]"),
    (lambda: (fresh(4, 3), torch.tensor([[0]]), fresh(1, 3)), ValueError, "slots", "slots must have shape [N]"),
    (lambda: (fresh(4, 3), torch.tensor([0], dtype=torch.int32), fresh(1, 3)), TypeError, "slots",
     "slots must be int64"),
    (lambda: (fresh(4, 3), torch.tensor([0, 1]), fresh(1, 3)), ValueError, "values",
     "values must have shape [N,D]=[2,3]"),
    (lambda: (fresh(4, 3), torch.tensor([0]), fresh(1, 3, dtype=torch.float64)), TypeError, "values",
     "values must have pool's dtype"),
    (lambda: (fresh(4, 3), torch.tensor([1, 4]), fresh(2, 3)), ValueError, "slots",
     "slots must hold rows of pool in [0, P=4), got 4"),
    (lambda: (fresh(4, 3), torch.tensor([-1]), fresh(1, 3)), ValueError, "slots", "got -1 at [0]"),
    (lambda: (fresh(1, 3).expand(4, 3), torch.tensor([0]), fresh(1, 3)), ValueError, "pool",
     "pool must be writable row by row"),
]


@pytest.mark.parametrize("args,error,name,op_words", BAD)
@pytest.mark.parametrize("entry", ["torch.ops.glm5", *BACKENDS])
def test_bad_input_names_the_argument(args, error, name, op_words, entry):
    """The op's own checks (its words) and the wrapper's on every backend (the
    argument named first, what was given after 'got'); nothing is written."""
    if DEVICE.type != "cpu" and ("rows of pool" in op_words or "got -1" in op_words):
        pytest.skip("slot ranges are checked on the host for CPU tensors only")
    pool, slots, values = args()
    before = pool.clone()
    with pytest.raises(error) as e:
        if entry == "torch.ops.glm5":
            torch.ops.glm5.cache_write(pool, slots.to(DEVICE), values)
        else:
            with glm5_ops.use_backend(entry):
                glm5_ops.cache_write(pool, slots.to(DEVICE), values)
    message = str(e.value)
    assert (op_words in message) if entry == "torch.ops.glm5" else (message.startswith(name) and "got" in message)
    torch.testing.assert_close(pool, before, rtol=0, atol=0, equal_nan=True)   # nothing written
