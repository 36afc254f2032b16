"""retrace.models."""
