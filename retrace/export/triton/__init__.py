"""Triton Inference Server deployment: repository generator, python-backend model, cached server env."""
