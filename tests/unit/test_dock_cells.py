"""Sealed cells (dockrl.dock.cells): tensors and arrays cross the dock as bytes the warehouses never decode."""

import pickle

import numpy as np
import pytest
import torch

from dockrl.dock.cells import Sealed, seal, seal_batch, unseal, unseal_batch
from dockrl.dock.metrics import payload_nbytes
from dockrl.dock.warehouse import Warehouse

TENSORS = [
    torch.arange(7, dtype=torch.int64),
    torch.randn(3, 5),
    torch.randn(6).to(torch.bfloat16),  # no numpy dtype: sealed as its bytes
    torch.tensor([True, False, True]),
    torch.zeros(0, dtype=torch.int32),
    torch.tensor(2.5),  # 0-d
    torch.randn(4, 6)[:, ::2],  # not contiguous
]


@pytest.mark.parametrize("value", TENSORS, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_tensors_come_back_bit_equal_and_writable_through_a_pickle(value):
    sealed = seal(value)
    assert isinstance(sealed, Sealed) and sealed.nbytes == value.nbytes
    back = unseal(pickle.loads(pickle.dumps(sealed, protocol=pickle.HIGHEST_PROTOCOL)))
    assert back.dtype == value.dtype and back.shape == value.shape
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (back, value)]
    assert torch.equal(*as_bytes)  # bit for bit (bf16 and bool included)
    back.zero_()  # writable: the buffer it arrived in, not a read-only view


@pytest.mark.parametrize(
    "value", [np.arange(5, dtype=np.int32), np.ones((2, 3), np.float16)[:, ::2], np.zeros((0, 4))]
)
def test_arrays_come_back_equal_and_writable(value):
    back = unseal(pickle.loads(pickle.dumps(seal(value))))
    assert back.dtype == value.dtype and back.shape == value.shape and np.array_equal(back, value)
    assert back.flags.writeable


@pytest.mark.parametrize("value", ["label", 1.5, [1, 2], {"a": 1}, np.array(["x", None], dtype=object)])
def test_other_values_pass_through_unchanged(value):
    assert seal(value) is value and unseal(value) is value


def test_a_value_repeated_across_rows_is_sealed_once_and_opened_once():
    prompt = torch.arange(1000)
    batch = seal_batch({"prompt_ids": [prompt] * 4, "label": ["a"] * 4})
    assert len({id(cell) for cell in batch["prompt_ids"]}) == 1
    assert len(pickle.dumps(batch)) < 2 * prompt.nbytes  # the frame carries the prompt once
    opened = unseal_batch(pickle.loads(pickle.dumps(batch)))
    assert len({id(cell) for cell in opened["prompt_ids"]}) == 1 and torch.equal(
        opened["prompt_ids"][3], prompt
    )


def test_a_warehouse_stores_sealed_cells_as_they_came_and_counts_their_bytes():
    warehouse = Warehouse(0)
    response = torch.arange(10)
    stored = warehouse.put([0], seal_batch({"response_ids": [response]}))
    cell = warehouse.get([0], ["response_ids"])["response_ids"][0]
    assert isinstance(cell, Sealed) and stored == payload_nbytes(response) == cell.nbytes
    assert torch.equal(unseal(cell), response)
