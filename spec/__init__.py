"""The Resume Contract as a model: the TLA+ spec, its Python encoding, and their tie to the code."""
