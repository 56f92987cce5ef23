"""The model zoo. Every module here is imported by `moetrain.registry` and registers its
models with `@register_model`; adding a model is adding one file."""
