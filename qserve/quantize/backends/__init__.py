"""Quantization backends: each turns (model, recipe, calibration data) into a saved checkpoint."""
