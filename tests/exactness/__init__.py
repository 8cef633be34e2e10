"""Token-exact generation: our engine against HF transformers, on tiny random models and SmolLM2."""
