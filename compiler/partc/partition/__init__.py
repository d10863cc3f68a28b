"""The `partition` vocabulary: graph, ownership, pipeline realization, boundaries, driver."""
