"""usc: a declarative model compiler and auto-parallelizer for PyTorch training."""
