"""Tools that run a model through a real cache (``calibration``). They sit above the manager
and the transformers integration, which they drive."""
