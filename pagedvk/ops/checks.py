"""Argument checks shared by the ops: each error names the argument and what is allowed."""

from __future__ import annotations

import numpy as np

from ..runtime.array import DeviceArray


def kind(name: str, a, strided: bool = False) -> None:
    """A numpy array (any strides: the ops copy numpy inputs to the device, and write numpy outputs and caches
    back through the caller's view) or a DeviceArray. A DeviceArray view (DeviceArray.__getitem__, reshape) is
    bound as its own range of its base's buffer, which must start where the device allows; one whose rows lie apart
    (not is_contiguous) only where `strided` (query, out, and the keys and values a cache write reads: the kernels
    take their token pitch), else ValueError naming the argument."""
    if not isinstance(a, (np.ndarray, DeviceArray)):
        raise TypeError(f"{name} must be a numpy array or a pagedvk.DeviceArray, not {type(a).__name__}")
    if isinstance(a, DeviceArray) and a.base is not None:
        view(name, a, strided)


def view(name: str, a: DeviceArray, strided: bool) -> None:
    """A DeviceArray view's checks (see `kind`)."""
    if not a.is_contiguous:
        if not strided:
            raise ValueError(f"{name} is a strided view (rows {a.pitch} elements apart, strides {a.strides}): this "
                             "argument must be contiguous (query, out, and a cache write's key and value take views "
                             "with rows apart)")
        if a.pitch % 4:
            raise ValueError(f"{name} is a view whose rows lie {a.pitch} elements apart (strides {a.strides}): the "
                             "kernels read and write whole quads, so the row pitch must be a multiple of 4 elements")
    if a.closed:
        return   # the op raises ClosedError when it binds it
    align = a.device.info.min_storage_buffer_offset_alignment
    at = a.buffer.offset
    if at % align:
        raise ValueError(f"{name} is a view starting at byte {at} of its buffer, not a multiple of {align} "
                         f"(minStorageBufferOffsetAlignment of {a.device.info.name}): a kernel can bind it only "
                         "from such an offset (slice at a column whose byte offset is one)")


def token_pitch(a, row: int) -> int:
    """Elements from one token's row of `a` ([tokens, ...]) to the next, as a kernel's q_pitch / out_pitch /
    key_pitch: a DeviceArray view's pitch, else `row` (numpy arguments are copied contiguous)."""
    return a.pitch if isinstance(a, DeviceArray) and a.ndim >= 1 and a.shape[0] > 1 else row


INT32_RANGE = (-(1 << 31), (1 << 31) - 1)


def ints(name: str, a):
    """A Python sequence of ints (a list, tuple or range, nested for a table) as an int32 numpy array, as numpy users
    pass block tables, lengths, slots and block pairs; numpy and device arrays, and anything else, are returned as
    they are, for the op's checks. TypeError naming the argument for a sequence of non-integers (floats, bools,
    ragged rows), ValueError for values outside int32."""
    if not isinstance(a, (list, tuple, range)):
        return a
    try:
        values = np.asarray(a)
    except ValueError as e:   # ragged rows
        raise TypeError(f"{name} must be an int32 array or a sequence of ints, got a sequence numpy cannot make an "
                        f"array of ({e})") from None
    if values.size and (values.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be an int32 array or a sequence of ints, got a sequence of {values.dtype} "
                        f"values")
    if values.size and (values.min() < INT32_RANGE[0] or values.max() > INT32_RANGE[1]):
        raise ValueError(f"{name} holds values outside int32 ({int(values.min())} to {int(values.max())})")
    return values.astype(np.int32)


def writable(name: str, a) -> None:
    """A numpy array an op writes its result into: refused before the GPU runs, not by numpy after it."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name} must be writable (a read-only numpy array cannot take the result)")


def integer(name: str, value, low: int, high: int | None = None) -> int:
    """An int argument (numpy integers too, bool not) in [low, high]; TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return int(value)


def ndim(name: str, a, n: int, layout: str) -> None:
    if len(a.shape) != n:
        raise ValueError(f"{name} must have {n} dimensions {layout}, got shape {tuple(a.shape)}")


def dtype(name: str, a, allowed) -> None:
    allowed = tuple(np.dtype(t) for t in allowed)
    if np.dtype(a.dtype) not in allowed:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, allowed))}, got {a.dtype}")


def dim(name: str, a, axis: int, expected: int, what: str) -> None:
    if a.shape[axis] != expected:
        raise ValueError(f"{name}.shape[{axis}] ({what}) must be {expected}, got {a.shape[axis]} (shape {tuple(a.shape)})")


def one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value}")


def host(a) -> np.ndarray:
    """A host view of a small array (block tables, lengths) for value checks."""
    return a.numpy() if isinstance(a, DeviceArray) else a


def tables(block_tables, seq_lens, num_seqs: int | None = None, source: str = "") -> None:
    """Kinds, shapes and dtypes of a block table int32 [num_seqs, max_blocks_per_seq] and its lengths
    int32 [num_seqs]; num_seqs from `source` when given, else from the block table."""
    kind("block_tables", block_tables)
    kind("seq_lens", seq_lens)
    ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    dtype("block_tables", block_tables, [np.int32])
    dtype("seq_lens", seq_lens, [np.int32])
    if num_seqs is not None:
        dim("block_tables", block_tables, 0, num_seqs, f"num_seqs, from {source}")
        dim("seq_lens", seq_lens, 0, num_seqs, f"num_seqs, from {source}")
    else:
        dim("seq_lens", seq_lens, 0, block_tables.shape[0], "num_seqs, from block_tables")


def block_table_values(block_tables, seq_lens, block_size: int, num_blocks: int) -> None:
    """seq_lens in [0, max_blocks_per_seq * block_size]; each sequence's used block ids in [0, num_blocks)."""
    bt, lens = host(block_tables), host(seq_lens)
    capacity = bt.shape[1] * block_size
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is outside [0, {capacity}] "
                         f"(max_blocks_per_seq {bt.shape[1]} x block_size {block_size})")
    used = (lens.astype(np.int64) + block_size - 1) // block_size
    in_use = np.arange(bt.shape[1])[None, :] < used[:, None]
    bad_ids = in_use & ((bt < 0) | (bt >= num_blocks))
    if bad_ids.any():
        s, j = map(int, np.argwhere(bad_ids)[0])
        raise ValueError(f"block_tables[{s}, {j}] = {int(bt[s, j])} is outside [0, {num_blocks}) "
                         f"(sequence {s} uses its first {int(used[s])} blocks)")
