"""The `parallel` vocabulary: parameter groups, shardings, linear formats, realization, layouts."""
