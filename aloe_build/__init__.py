"""ALOE construction: edit requests, model loading, the build pipeline and evaluation."""
