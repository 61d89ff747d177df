"""Model operations: the registry, serving from it, data contracts, the container image, capacity."""
