"""OIP JSON tensors of UINT8 pixels: flat (what tritonclient sends) or nested row-major arrays."""

from __future__ import annotations

import numpy as np
import pytest

from visionserve import oip
from visionserve.errors import InvalidInput


def test_flat_and_nested_arrays_give_the_same_pixels():
    img = np.random.default_rng(1).integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
    flat = oip.json_uint8(img.reshape(-1).tolist(), list(img.shape))
    nested = oip.json_uint8(img.tolist(), list(img.shape))
    assert flat.dtype == np.uint8 and (flat == img.reshape(-1)).all() and (nested == flat).all()


@pytest.mark.parametrize("data, flat", [
    ([[1], 2], [1, 2]), ([1, [2, 3]], [1, 2, 3]), ([[1, [2]], [3]], [1, 2, 3]), ([[]], []), ([], []),
])
def test_irregular_nesting_is_read_in_row_major_order(data, flat):
    assert oip.json_uint8(data, [len(flat)]).tolist() == flat


@pytest.mark.parametrize("data", [[1, True], [[True]], [1, 2.0], [1, "a"], [1, [None]], [256], [[-1]],
                                  [2**63], [[1, 2**64]], [-2**63 - 1]])  # past int64: 400, not 500
def test_anything_but_integers_0_to_255_is_refused(data):
    with pytest.raises(InvalidInput, match="integers 0..255"):
        oip.json_uint8(data, [1])


def test_data_must_be_an_array():
    with pytest.raises(InvalidInput, match="JSON array"):
        oip.json_uint8("pixels", [1])
