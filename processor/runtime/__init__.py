"""A group's batch inside `applyInPandasWithState`: slices, stores, owners, placement."""
