"""The reference the chain tests compare with: a plain fold of committed batches."""

from __future__ import annotations


def fold(batches: list[dict], slice_id: int) -> dict[bytes, bytes]:
    """Slice `slice_id`'s state after `batches` ({slice: {key: value or None}} each)."""
    state: dict[bytes, bytes] = {}
    for changed in batches:
        for k, v in changed.get(slice_id, {}).items():
            if v is None:
                state.pop(k, None)
            else:
                state[k] = v
    return state
